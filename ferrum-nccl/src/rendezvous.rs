//! Handing NCCL's 128-byte unique id from rank 0 to the other ranks, without MPI.
//!
//! The rendezvous is generic over the bytes: it moves an opaque `[u8; ID_LEN]` and never
//! touches NCCL or a GPU, so it is unit-tested on any machine.
//!
//! Two transports:
//! - [`Rendezvous::File`]: rank 0 writes the id to a file on a shared file system, atomically
//!   (write a temporary file in the same directory, `fsync`, then `rename`), so a reader sees
//!   either no file or a whole one. The other ranks poll for the file until a timeout. The file is
//!   a short text line, `ferrum-nccl-id v1 <256 hex digits>`, so a stale or foreign file is
//!   reported as such instead of being fed to NCCL. Use a fresh path per launch (a file left
//!   by a previous run would otherwise be read by the next run's ranks).
//! - [`Rendezvous::Tcp`]: rank 0 listens on an address and answers each rank's request with
//!   the id; the other ranks connect, retrying until a timeout. The exchange is tiny:
//!   request `b"FRNCCLRQ" | rank: u32 LE | world_size: u32 LE`, answer `b"FRNCCLID" | id`, or
//!   `b"FRNCCLER" | len: u32 LE | utf-8 text` when the request is refused (e.g. the world sizes
//!   differ). Rank 0's server runs on a background thread (rank 0 must call
//!   `ncclCommInitRank` meanwhile); [`Publication::finish`] waits for every rank to be served.

use crate::error::RendezvousError;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Length of an NCCL unique id (`ncclUniqueId::internal`).
pub const ID_LEN: usize = 128;

/// The header of an id file.
const FILE_HEADER: &str = "ferrum-nccl-id v1 ";
const TCP_REQUEST: &[u8; 8] = b"FRNCCLRQ";
const TCP_ID: &[u8; 8] = b"FRNCCLID";
const TCP_ERR: &[u8; 8] = b"FRNCCLER";
/// Longest refusal text a client accepts.
const MAX_ERR_LEN: u32 = 4096;

/// Timeouts of a rendezvous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// How long a rank waits for the id (file or TCP), and how long rank 0's TCP server waits
    /// for all ranks to fetch it.
    pub timeout: Duration,
    /// Pause between two polls of the id file, or two TCP connection attempts.
    pub poll_interval: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions { timeout: Duration::from_secs(120), poll_interval: Duration::from_millis(20) }
    }
}

/// How rank 0 hands the unique id to the other ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// A file path visible to every rank (shared file system for several nodes).
    File(PathBuf),
    /// A `host:port` address: rank 0 listens on it, the other ranks connect to it.
    /// Port 0 lets rank 0 pick a free port (see [`Publication::local_addr`]); only useful when
    /// the other ranks learn the port some other way (tests).
    Tcp(String),
}

impl Rendezvous {
    /// Parses `file:<path>` or `tcp:<host>:<port>` (e.g. from a command-line flag).
    pub fn parse(spec: &str) -> Result<Self, RendezvousError> {
        if let Some(path) = spec.strip_prefix("file:") {
            if path.is_empty() {
                return Err(RendezvousError::InvalidArgument("empty path in `file:` rendezvous".into()));
            }
            Ok(Rendezvous::File(PathBuf::from(path)))
        } else if let Some(addr) = spec.strip_prefix("tcp:") {
            if !addr.contains(':') {
                return Err(RendezvousError::InvalidArgument(format!("`tcp:{addr}` needs host:port")));
            }
            Ok(Rendezvous::Tcp(addr.to_string()))
        } else {
            Err(RendezvousError::InvalidArgument(format!(
                "rendezvous `{spec}` must start with `file:` or `tcp:` (e.g. file:/shared/run42.id, tcp:10.0.0.1:29500)"
            )))
        }
    }

    /// Rank 0's side: makes `id` available to ranks `1..world_size`.
    ///
    /// For a file, the id is written (atomically) before this returns. For TCP, a server thread
    /// starts listening before this returns and serves until every rank has fetched the id or
    /// `opts.timeout` passed; call [`Publication::finish`] (after `ncclCommInitRank`) to learn
    /// whether every rank was served. With `world_size == 1` there is nobody to serve and no
    /// server is started.
    pub fn publish(
        &self,
        id: &[u8; ID_LEN],
        world_size: usize,
        opts: &RendezvousOptions,
    ) -> Result<Publication, RendezvousError> {
        check_world(0, world_size)?;
        match self {
            Rendezvous::File(path) => {
                write_id_file(path, id)?;
                Ok(Publication { server: None })
            }
            Rendezvous::Tcp(addr) => {
                if world_size == 1 {
                    return Ok(Publication { server: None });
                }
                let server = TcpIdServer::start(addr.as_str(), *id, world_size, *opts)?;
                Ok(Publication { server: Some(server) })
            }
        }
    }

    /// The side of ranks `1..world_size`: waits (up to `opts.timeout`) for rank 0's id.
    pub fn fetch(
        &self,
        rank: usize,
        world_size: usize,
        opts: &RendezvousOptions,
    ) -> Result<[u8; ID_LEN], RendezvousError> {
        check_world(rank, world_size)?;
        if rank == 0 {
            return Err(RendezvousError::InvalidArgument("rank 0 publishes the id; it does not fetch it".into()));
        }
        match self {
            Rendezvous::File(path) => wait_id_file(path, opts),
            Rendezvous::Tcp(addr) => fetch_tcp(addr, rank, world_size, opts),
        }
    }
}

fn check_world(rank: usize, world_size: usize) -> Result<(), RendezvousError> {
    if world_size == 0 || rank >= world_size {
        return Err(RendezvousError::InvalidArgument(format!("rank {rank} is not below world size {world_size}")));
    }
    if u32::try_from(world_size).is_err() {
        return Err(RendezvousError::InvalidArgument(format!("world size {world_size} is too large")));
    }
    Ok(())
}

/// What rank 0 holds while the other ranks fetch the id (the TCP server, if any).
#[derive(Debug)]
pub struct Publication {
    server: Option<TcpIdServer>,
}

impl Publication {
    /// The address the TCP server listens on (None for a file rendezvous or a world of one).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|s| s.local_addr)
    }

    /// Waits until every rank fetched the id (TCP) and reports the server's outcome: a
    /// [`RendezvousError::Timeout`] names the ranks that never came. Immediate for a file.
    pub fn finish(self) -> Result<(), RendezvousError> {
        match self.server {
            Some(server) => server.wait(),
            None => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// File transport
// ---------------------------------------------------------------------------------------------

/// Encodes an id as the one-line text of an id file.
pub fn encode_id_file(id: &[u8; ID_LEN]) -> String {
    let mut s = String::with_capacity(FILE_HEADER.len() + 2 * ID_LEN + 1);
    s.push_str(FILE_HEADER);
    for b in id {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s.push('\n');
    s
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Decodes the text of an id file; the error says what is wrong.
pub fn decode_id_file(bytes: &[u8]) -> Result<[u8; ID_LEN], String> {
    let text = std::str::from_utf8(bytes).map_err(|_| format!("{} bytes of binary data, not text", bytes.len()))?;
    let text = text.strip_suffix('\n').unwrap_or(text);
    let Some(hex) = text.strip_prefix(FILE_HEADER) else {
        let shown: String = text.chars().take(40).collect();
        return Err(format!("it does not start with `{}` (it starts with {shown:?})", FILE_HEADER.trim_end()));
    };
    if hex.len() != 2 * ID_LEN {
        return Err(format!("expected {} hex digits after the header, found {} characters", 2 * ID_LEN, hex.len()));
    }
    let mut id = [0u8; ID_LEN];
    for (i, pair) in hex.as_bytes().chunks_exact(2).enumerate() {
        let hi = hex_val(pair[0]);
        let lo = hex_val(pair[1]);
        match (hi, lo) {
            (Some(hi), Some(lo)) => id[i] = (hi << 4) | lo,
            _ => return Err(format!("non-hex character in the id at byte {i}")),
        }
    }
    Ok(id)
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Writes an id file atomically: a temporary file in the same directory, `fsync`, `rename`.
pub fn write_id_file(path: &Path, id: &[u8; ID_LEN]) -> Result<(), RendezvousError> {
    let name = path
        .file_name()
        .ok_or_else(|| RendezvousError::InvalidArgument(format!("id file path {} has no file name", path.display())))?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = path.with_file_name(format!(".{}.tmp.{}.{nanos}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(RendezvousError::io(format!("creating {}", tmp.display())))?;
        f.write_all(encode_id_file(id).as_bytes())
            .map_err(RendezvousError::io(format!("writing {}", tmp.display())))?;
        f.sync_all().map_err(RendezvousError::io(format!("syncing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(RendezvousError::io(format!(
            "renaming {} to {}",
            tmp.display(),
            path.display()
        )))
    })();
    if result.is_err() {
        // Best effort: do not leave the temporary behind; the original error is what matters.
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Polls for an id file until it appears (then decodes it) or `opts.timeout` passes.
pub fn wait_id_file(path: &Path, opts: &RendezvousOptions) -> Result<[u8; ID_LEN], RendezvousError> {
    let start = Instant::now();
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                return decode_id_file(&bytes)
                    .map_err(|reason| RendezvousError::BadIdFile { path: path.to_path_buf(), reason });
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RendezvousError::io(format!("reading {}", path.display()))(e)),
        }
        let waited = start.elapsed();
        if waited >= opts.timeout {
            return Err(RendezvousError::Timeout {
                what: format!(
                    "waiting for rank 0 to write the NCCL id file {} (is rank 0 running, with the same path?)",
                    path.display()
                ),
                waited,
            });
        }
        std::thread::sleep(opts.poll_interval.min(opts.timeout - waited));
    }
}

// ---------------------------------------------------------------------------------------------
// TCP transport
// ---------------------------------------------------------------------------------------------

/// Rank 0's TCP id server (a background thread).
#[derive(Debug)]
pub struct TcpIdServer {
    local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), RendezvousError>>>,
}

impl TcpIdServer {
    /// Binds `addr` and serves `id` to ranks `1..world_size` until all came or `opts.timeout`.
    pub fn start(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        id: [u8; ID_LEN],
        world_size: usize,
        opts: RendezvousOptions,
    ) -> Result<Self, RendezvousError> {
        check_world(0, world_size)?;
        let shown = format!("{addr:?}");
        let listener = TcpListener::bind(addr).map_err(RendezvousError::io(format!("binding {shown}")))?;
        let local_addr = listener.local_addr().map_err(RendezvousError::io("reading the listening address"))?;
        listener.set_nonblocking(true).map_err(RendezvousError::io("making the listener non-blocking"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferrum-nccl-rdv".into())
            .spawn(move || serve(listener, id, world_size, opts, &stop2))
            .map_err(RendezvousError::io("spawning the rendezvous server thread"))?;
        Ok(TcpIdServer { local_addr, stop, thread: Some(thread) })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits for the server thread: Ok once every rank was served.
    pub fn wait(mut self) -> Result<(), RendezvousError> {
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(RendezvousError::Protocol { peer: "server thread".into(), reason: "it panicked".into() })
            }),
            None => Ok(()),
        }
    }
}

impl Drop for TcpIdServer {
    fn drop(&mut self) {
        // Tell the thread to stop at its next poll; it holds no lock, so detaching is fine.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(
    listener: TcpListener,
    id: [u8; ID_LEN],
    world_size: usize,
    opts: RendezvousOptions,
    stop: &AtomicBool,
) -> Result<(), RendezvousError> {
    let start = Instant::now();
    let mut served = BTreeSet::new();
    while served.len() + 1 < world_size {
        if stop.load(Ordering::Relaxed) {
            return Err(RendezvousError::Protocol { peer: "rank 0".into(), reason: "server stopped".into() });
        }
        let waited = start.elapsed();
        if waited >= opts.timeout {
            let missing: Vec<usize> = (1..world_size).filter(|r| !served.contains(r)).collect();
            return Err(RendezvousError::Timeout {
                what: format!(
                    "serving the NCCL id on {}: ranks {missing:?} of {world_size} never fetched it",
                    listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                ),
                waited,
            });
        }
        match listener.accept() {
            Ok((stream, peer)) => match answer(stream, &id, world_size, opts.timeout - waited) {
                Ok(rank) => {
                    served.insert(rank);
                }
                Err(e) => tracing::warn!(%peer, error = %e, "ferrum-nccl rendezvous: ignored a bad request"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(opts.poll_interval.min(Duration::from_millis(10)).max(Duration::from_millis(1)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RendezvousError::io("accepting a rendezvous connection")(e)),
        }
    }
    Ok(())
}

/// Answers one request; returns the served rank.
fn answer(
    mut stream: TcpStream,
    id: &[u8; ID_LEN],
    world_size: usize,
    remaining: Duration,
) -> Result<usize, RendezvousError> {
    let io_timeout = Some(remaining.clamp(Duration::from_millis(100), Duration::from_secs(10)));
    stream.set_nonblocking(false).map_err(RendezvousError::io("configuring a connection"))?;
    stream.set_read_timeout(io_timeout).map_err(RendezvousError::io("configuring a connection"))?;
    stream.set_write_timeout(io_timeout).map_err(RendezvousError::io("configuring a connection"))?;
    let mut req = [0u8; 16];
    stream.read_exact(&mut req).map_err(RendezvousError::io("reading a rendezvous request"))?;
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    if &req[..8] != TCP_REQUEST {
        return Err(RendezvousError::Protocol { peer, reason: "not a ferrum-nccl rendezvous request".into() });
    }
    let rank = u32::from_le_bytes([req[8], req[9], req[10], req[11]]) as usize;
    let their_world = u32::from_le_bytes([req[12], req[13], req[14], req[15]]) as usize;
    let refusal = if their_world != world_size {
        Some(format!("rank 0 runs a world of {world_size} ranks, the request says {their_world}"))
    } else if rank == 0 || rank >= world_size {
        Some(format!("rank {rank} is not in 1..{world_size}"))
    } else {
        None
    };
    if let Some(reason) = refusal {
        let mut msg = Vec::with_capacity(12 + reason.len());
        msg.extend_from_slice(TCP_ERR);
        msg.extend_from_slice(&(reason.len() as u32).to_le_bytes());
        msg.extend_from_slice(reason.as_bytes());
        // Best effort: the refusal is also reported (logged) on this side.
        let _ = stream.write_all(&msg);
        return Err(RendezvousError::Protocol { peer, reason });
    }
    let mut msg = [0u8; 8 + ID_LEN];
    msg[..8].copy_from_slice(TCP_ID);
    msg[8..].copy_from_slice(id);
    stream.write_all(&msg).map_err(RendezvousError::io(format!("sending the id to rank {rank}")))?;
    stream.flush().map_err(RendezvousError::io(format!("sending the id to rank {rank}")))?;
    Ok(rank)
}

/// One rank's side of the TCP rendezvous: connect (retrying) and read the id.
pub fn fetch_tcp(
    addr: &str,
    rank: usize,
    world_size: usize,
    opts: &RendezvousOptions,
) -> Result<[u8; ID_LEN], RendezvousError> {
    check_world(rank, world_size)?;
    let start = Instant::now();
    let mut last_error = String::from("no attempt");
    loop {
        let waited = start.elapsed();
        if waited >= opts.timeout {
            return Err(RendezvousError::Timeout {
                what: format!("fetching the NCCL id from rank 0 at {addr} (last error: {last_error})"),
                waited,
            });
        }
        let remaining = opts.timeout - waited;
        match try_fetch(addr, rank, world_size, remaining) {
            Ok(id) => return Ok(id),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(msg)) => last_error = msg,
        }
        let waited = start.elapsed();
        if waited < opts.timeout {
            std::thread::sleep(opts.poll_interval.min(opts.timeout - waited));
        }
    }
}

enum Attempt {
    Retry(String),
    Fatal(RendezvousError),
}

fn try_fetch(addr: &str, rank: usize, world_size: usize, remaining: Duration) -> Result<[u8; ID_LEN], Attempt> {
    let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(a) => a.collect(),
        // DNS may not be up yet on a fresh node: retry.
        Err(e) => return Err(Attempt::Retry(format!("resolving {addr}: {e}"))),
    };
    let Some(sock) = addrs.first() else {
        return Err(Attempt::Fatal(RendezvousError::InvalidArgument(format!("{addr} resolves to no address"))));
    };
    let io_timeout = remaining.clamp(Duration::from_millis(10), Duration::from_secs(10));
    let mut stream = TcpStream::connect_timeout(sock, io_timeout).map_err(|e| Attempt::Retry(e.to_string()))?;
    let retry = |e: std::io::Error| Attempt::Retry(e.to_string());
    stream.set_read_timeout(Some(io_timeout)).map_err(retry)?;
    stream.set_write_timeout(Some(io_timeout)).map_err(retry)?;
    let mut req = [0u8; 16];
    req[..8].copy_from_slice(TCP_REQUEST);
    req[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    req[12..].copy_from_slice(&(world_size as u32).to_le_bytes());
    stream.write_all(&req).map_err(retry)?;
    let mut tag = [0u8; 8];
    stream.read_exact(&mut tag).map_err(retry)?;
    let peer = sock.to_string();
    if &tag == TCP_ID {
        let mut id = [0u8; ID_LEN];
        stream.read_exact(&mut id).map_err(retry)?;
        Ok(id)
    } else if &tag == TCP_ERR {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(retry)?;
        let len = u32::from_le_bytes(len).min(MAX_ERR_LEN) as usize;
        let mut text = vec![0u8; len];
        stream.read_exact(&mut text).map_err(retry)?;
        Err(Attempt::Fatal(RendezvousError::Protocol {
            peer,
            reason: format!("rank 0 refused: {}", String::from_utf8_lossy(&text)),
        }))
    } else {
        Err(Attempt::Fatal(RendezvousError::Protocol {
            peer,
            reason: "the server is not a ferrum-nccl rendezvous (unexpected answer)".into(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(seed: u8) -> [u8; ID_LEN] {
        let mut x = [0u8; ID_LEN];
        let mut s = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
        for b in &mut x {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            *b = s as u8;
        }
        x
    }

    fn quick() -> RendezvousOptions {
        RendezvousOptions { timeout: Duration::from_millis(300), poll_interval: Duration::from_millis(5) }
    }

    #[test]
    fn id_file_round_trip() {
        for seed in 0..8 {
            let x = id(seed);
            assert_eq!(decode_id_file(encode_id_file(&x).as_bytes()).unwrap(), x);
        }
        // Upper-case hex and a missing final newline are accepted.
        let x = id(3);
        let text = encode_id_file(&x).to_uppercase().replace("FERRUM-NCCL-ID V1 ", FILE_HEADER);
        assert_eq!(decode_id_file(text.trim_end().as_bytes()).unwrap(), x);
    }

    #[test]
    fn file_publish_then_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.id");
        let rdv = Rendezvous::File(path.clone());
        let x = id(1);
        rdv.publish(&x, 4, &quick()).unwrap().finish().unwrap();
        for rank in 1..4 {
            assert_eq!(rdv.fetch(rank, 4, &quick()).unwrap(), x);
        }
        // No temporary file is left next to the id file.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("run.id")]);
        // Publishing again replaces the id atomically.
        let y = id(2);
        rdv.publish(&y, 4, &quick()).unwrap();
        assert_eq!(rdv.fetch(3, 4, &quick()).unwrap(), y);
    }

    #[test]
    fn file_fetch_waits_for_a_late_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("late.id");
        let x = id(7);
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                write_id_file(&path, &x).unwrap();
            })
        };
        let opts = RendezvousOptions { timeout: Duration::from_secs(10), poll_interval: Duration::from_millis(5) };
        assert_eq!(Rendezvous::File(path).fetch(1, 2, &opts).unwrap(), x);
        writer.join().unwrap();
    }

    #[test]
    fn file_fetch_times_out_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("never.id");
        let t = Instant::now();
        let err = Rendezvous::File(path).fetch(1, 2, &quick()).unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(t.elapsed() < Duration::from_secs(5));
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{msg}");
        assert!(msg.contains("never.id") && msg.contains("timed out"), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn garbage_id_file_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut nonhex = encode_id_file(&id(0));
        nonhex.replace_range(FILE_HEADER.len()..FILE_HEADER.len() + 2, "zz");
        let cases: [(&str, Vec<u8>); 5] = [
            ("binary", vec![0u8, 159, 146, 150, 255]),
            ("other", b"hello world\n".to_vec()),
            ("short", b"ferrum-nccl-id v1 abcd\n".to_vec()),
            ("nonhex", nonhex.into_bytes()),
            ("raw-128-bytes", id(1).to_vec()),
        ];
        for (name, content) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            let err = Rendezvous::File(path).fetch(1, 2, &quick()).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, RendezvousError::BadIdFile { .. }), "{name}: {msg}");
            assert!(msg.contains("not a valid ferrum-nccl id file"), "{msg}");
            println!("{name}: {msg}");
        }
    }

    #[test]
    fn tcp_serves_every_rank() {
        let world = 4;
        let x = id(9);
        let opts = RendezvousOptions { timeout: Duration::from_secs(20), poll_interval: Duration::from_millis(5) };
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, world, &opts).unwrap();
        let addr = publication.local_addr().unwrap().to_string();
        let clients: Vec<_> = (1..world)
            .map(|rank| {
                let addr = addr.clone();
                std::thread::spawn(move || Rendezvous::Tcp(addr).fetch(rank, world, &opts))
            })
            .collect();
        for c in clients {
            assert_eq!(c.join().unwrap().unwrap(), x);
        }
        publication.finish().unwrap();
    }

    #[test]
    fn tcp_client_retries_until_the_server_is_up() {
        // Reserve a free port, release it, and start the server on it a little later.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let x = id(4);
        let opts = RendezvousOptions { timeout: Duration::from_secs(20), poll_interval: Duration::from_millis(5) };
        let client = {
            let addr = addr.clone();
            std::thread::spawn(move || Rendezvous::Tcp(addr).fetch(1, 2, &opts))
        };
        std::thread::sleep(Duration::from_millis(150));
        let publication = Rendezvous::Tcp(addr).publish(&x, 2, &opts).unwrap();
        assert_eq!(client.join().unwrap().unwrap(), x);
        publication.finish().unwrap();
    }

    #[test]
    fn tcp_client_times_out_without_a_server() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let t = Instant::now();
        let err = Rendezvous::Tcp(format!("127.0.0.1:{port}")).fetch(1, 2, &quick()).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5));
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{msg}");
        assert!(msg.contains("fetching the NCCL id"), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn tcp_server_times_out_naming_missing_ranks() {
        let x = id(5);
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 3, &quick()).unwrap();
        let addr = publication.local_addr().unwrap().to_string();
        assert_eq!(Rendezvous::Tcp(addr).fetch(2, 3, &quick()).unwrap(), x);
        let err = publication.finish().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{msg}");
        assert!(msg.contains("ranks [1] of 3"), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn tcp_world_size_mismatch_is_refused() {
        let x = id(6);
        let opts = RendezvousOptions { timeout: Duration::from_secs(5), poll_interval: Duration::from_millis(5) };
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 2, &opts).unwrap();
        let addr = publication.local_addr().unwrap().to_string();
        let err = Rendezvous::Tcp(addr).fetch(1, 3, &opts).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Protocol { .. }), "{msg}");
        assert!(msg.contains("world of 2"), "{msg}");
        drop(publication);
    }

    #[test]
    fn tcp_garbage_server_is_a_protocol_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = [0u8; 16];
            s.read_exact(&mut req).unwrap();
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        });
        let err = Rendezvous::Tcp(addr).fetch(1, 2, &quick()).unwrap_err();
        assert!(matches!(err, RendezvousError::Protocol { .. }), "{err}");
        server.join().unwrap();
    }

    #[test]
    fn bad_arguments() {
        let r = Rendezvous::Tcp("127.0.0.1:1".into());
        assert!(matches!(r.fetch(0, 2, &quick()), Err(RendezvousError::InvalidArgument(_))));
        assert!(matches!(r.fetch(2, 2, &quick()), Err(RendezvousError::InvalidArgument(_))));
        assert!(matches!(r.publish(&id(0), 0, &quick()), Err(RendezvousError::InvalidArgument(_))));
        assert_eq!(Rendezvous::parse("file:/x/y.id").unwrap(), Rendezvous::File("/x/y.id".into()));
        assert_eq!(Rendezvous::parse("tcp:10.0.0.1:29500").unwrap(), Rendezvous::Tcp("10.0.0.1:29500".into()));
        assert!(Rendezvous::parse("udp:1.2.3.4:5").is_err());
        assert!(Rendezvous::parse("tcp:localhost").is_err());
    }
}
