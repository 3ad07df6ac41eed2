//! Handing NCCL's 128-byte unique id from rank 0 to the other ranks, without MPI.
//!
//! The rendezvous is generic over the bytes: it moves an opaque `[u8; ID_LEN]` and never
//! touches NCCL or a GPU, so it is unit-tested on any machine.
//!
//! Two transports:
//! - [`Rendezvous::File`]: rank 0 writes the id to a file on a shared file system, atomically
//!   (write a temporary file in the same directory, `fsync`, then `rename`), so a reader sees
//!   either no file or a whole one. The other ranks poll for the file until a timeout. The file is
//!   a short text line, `ferrum-nccl-id v2 world=<n> nonce=<16 hex digits> id=<256 hex digits>`,
//!   so a foreign file is reported as such instead of being fed to NCCL, and a file left by
//!   another launch is recognised: its launch nonce (when the ranks were given one, see
//!   [`RendezvousOptions::nonce`]) or its world size differs, and the readers keep waiting for
//!   rank 0 to replace it. Without a nonce, use a fresh path per launch: a file of an earlier
//!   launch with the same world size cannot be told apart.
//! - [`Rendezvous::Tcp`]: rank 0 listens on an address and answers each rank's request with
//!   the id; the other ranks connect, retrying until a timeout. The exchange is tiny:
//!   request `b"FRNCCLRQ" | rank: u32 LE | world_size: u32 LE`, answer `b"FRNCCLID" | id`, or
//!   `b"FRNCCLER" | len: u32 LE | utf-8 text` when the request is refused (e.g. the world sizes
//!   differ). Rank 0's server runs on a background thread (rank 0 must initialise its
//!   communicator meanwhile) and answers each connection on a thread of its own, so a peer that
//!   connects and sends nothing delays nobody; [`Publication::is_done`] tells whether it ended
//!   and [`Publication::finish`] reports how.

use crate::error::RendezvousError;
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Length of an NCCL unique id (`ncclUniqueId::internal`).
pub const ID_LEN: usize = 128;

/// The header of an id file.
const FILE_HEADER: &str = "ferrum-nccl-id v2 ";
/// The header of the id files of earlier ferrum-nccl versions (no world size, no nonce).
const FILE_HEADER_V1: &str = "ferrum-nccl-id v1 ";
const TCP_REQUEST: &[u8; 8] = b"FRNCCLRQ";
const TCP_ID: &[u8; 8] = b"FRNCCLID";
const TCP_ERR: &[u8; 8] = b"FRNCCLER";
/// Longest refusal text a client accepts.
const MAX_ERR_LEN: u32 = 4096;
/// How long rank 0's server waits for a connection's request (a real rank sends it right after
/// connecting) and for the answer to be written.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Most connections rank 0's server answers at once (one thread each); more are closed at once
/// (a real rank then retries).
const MAX_CONNECTIONS: usize = 64;

/// Timeouts of a rendezvous (and of the NCCL initialisation that follows it, see
/// `NcclRank::init_rank_rendezvous`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// How long a rank waits for the id (file or TCP), and how long rank 0's TCP server waits
    /// for all ranks to fetch it.
    pub timeout: Duration,
    /// Pause between two polls of the id file, or two TCP connection attempts.
    pub poll_interval: Duration,
    /// This launch's nonce, when the launcher gives every rank the same one (e.g. a random
    /// number in an environment variable). Rank 0 writes it into the id file, and the other ranks
    /// take only an id file that carries it: a file left by another launch is never used (they
    /// wait for rank 0 to replace it, and name it in their timeout error). `None`: rank 0 writes a
    /// random nonce and the other ranks take any. The TCP transport ignores it (the id comes
    /// from the running rank 0).
    pub nonce: Option<u64>,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions { timeout: Duration::from_secs(120), poll_interval: Duration::from_millis(20), nonce: None }
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
    /// Parses `file:<path>` or `tcp:<host>:<port>` (e.g. from a command-line flag). The port
    /// must be a number in `0..=65535`, and an IPv6 host must be bracketed (`tcp:[::1]:29500`).
    pub fn parse(spec: &str) -> Result<Self, RendezvousError> {
        if let Some(path) = spec.strip_prefix("file:") {
            if path.is_empty() {
                return Err(RendezvousError::InvalidArgument("empty path in `file:` rendezvous".into()));
            }
            Ok(Rendezvous::File(PathBuf::from(path)))
        } else if let Some(addr) = spec.strip_prefix("tcp:") {
            split_host_port(addr).map_err(|why| RendezvousError::InvalidArgument(format!("`tcp:{addr}`: {why}")))?;
            Ok(Rendezvous::Tcp(addr.to_string()))
        } else {
            Err(RendezvousError::InvalidArgument(format!(
                "rendezvous `{spec}` must start with `file:` or `tcp:` (e.g. file:/shared/run42.id, tcp:10.0.0.1:29500)"
            )))
        }
    }

    /// Rank 0's side: makes `id` available to ranks `1..world_size`.
    ///
    /// For a file, the id is written (atomically, with `world_size` and the launch nonce)
    /// before this returns. For TCP, a server thread starts listening before this returns and
    /// serves until every rank has fetched the id or `opts.timeout` passed; call
    /// [`Publication::finish`] (after the NCCL initialisation) to learn whether every rank was
    /// served. With `world_size == 1` there is nobody to serve and no server is started.
    pub fn publish(
        &self,
        id: &[u8; ID_LEN],
        world_size: usize,
        opts: &RendezvousOptions,
    ) -> Result<Publication, RendezvousError> {
        check_world(0, world_size)?;
        match self {
            Rendezvous::File(path) => {
                let nonce = opts.nonce.unwrap_or_else(random_nonce);
                write_id_file(path, &IdFile { id: *id, world_size, nonce })?;
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
            Rendezvous::File(path) => wait_id_file(path, world_size, opts),
            Rendezvous::Tcp(addr) => fetch_tcp(addr, rank, world_size, opts),
        }
    }
}

/// Splits `host:port`: the port must be a `u16`, the host non-empty, and an IPv6 host
/// bracketed (else `::1:80` would silently mean host `::1`, port 80).
fn split_host_port(addr: &str) -> Result<(&str, u16), String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("needs host:port".into());
    };
    if host.is_empty() {
        return Err("the host is empty".into());
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err("an IPv6 host needs brackets, e.g. tcp:[::1]:29500".into());
    }
    let port = port.parse::<u16>().map_err(|_| format!("the port `{port}` is not a number in 0..=65535"))?;
    Ok((host, port))
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

/// A nonce for an id file when the launcher gave none: different for every call in practice.
fn random_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState's keys come from the OS's random source (per thread, then incremented for
    // every new state), so no two calls, here or in another process, share them in practice;
    // the time and the process id are mixed in for good measure.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    h.finish()
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

    /// True once there is nothing left to serve: the TCP server thread ended (every rank was
    /// served, the timeout passed, or it failed), or there was none. Never blocks; then
    /// [`finish`](Self::finish) returns at once.
    pub fn is_done(&self) -> bool {
        self.server.as_ref().is_none_or(TcpIdServer::is_done)
    }

    /// Waits until every rank fetched the id (TCP) and reports the server's outcome: a
    /// [`RendezvousError::Timeout`] names the ranks that never came (and the requests it
    /// refused). Immediate for a file. Bounded: the server gives up at its timeout.
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

/// What an id file holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IdFile {
    /// NCCL's unique id.
    pub id: [u8; ID_LEN],
    /// The number of ranks of the launch that wrote it.
    pub world_size: usize,
    /// The launch's nonce (see [`RendezvousOptions::nonce`]).
    pub nonce: u64,
}

impl std::fmt::Debug for IdFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdFile")
            .field("world_size", &self.world_size)
            .field("nonce", &format_args!("{:016x}", self.nonce))
            .finish_non_exhaustive()
    }
}

/// Encodes an id file's one-line text.
pub fn encode_id_file(file: &IdFile) -> String {
    let mut s = String::with_capacity(FILE_HEADER.len() + 64 + 2 * ID_LEN + 1);
    s.push_str(FILE_HEADER);
    s.push_str(&format!("world={} nonce={:016x} id=", file.world_size, file.nonce));
    for b in &file.id {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s.push('\n');
    s
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Decodes the text of an id file; the error says what is wrong.
pub fn decode_id_file(bytes: &[u8]) -> Result<IdFile, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| format!("{} bytes of binary data, not text", bytes.len()))?;
    let text = text.strip_suffix('\n').unwrap_or(text);
    if text.starts_with(FILE_HEADER_V1) {
        return Err("it was written by an earlier ferrum-nccl (format v1, which carries no world size or launch \
                    nonce): it belongs to another launch"
            .into());
    }
    let Some(rest) = text.strip_prefix(FILE_HEADER) else {
        let shown: String = text.chars().take(40).collect();
        return Err(format!("it does not start with `{}` (it starts with {shown:?})", FILE_HEADER.trim_end()));
    };
    let mut fields = rest.split(' ');
    let mut field = |name: &str| -> Result<&str, String> {
        fields
            .next()
            .and_then(|f| f.strip_prefix(name))
            .and_then(|f| f.strip_prefix('='))
            .ok_or_else(|| format!("expected `{name}=...` after the header"))
    };
    let world = field("world")?;
    let world_size =
        world.parse::<usize>().ok().filter(|&w| w > 0).ok_or_else(|| format!("bad world size `{world}`"))?;
    let nonce = field("nonce")?;
    if nonce.len() != 16 {
        return Err(format!("bad nonce `{nonce}` (16 hex digits expected)"));
    }
    let nonce = u64::from_str_radix(nonce, 16).map_err(|_| format!("bad nonce `{nonce}` (16 hex digits expected)"))?;
    let hex = field("id")?;
    if fields.next().is_some() {
        return Err("unexpected text after the id".into());
    }
    if hex.len() != 2 * ID_LEN {
        return Err(format!("expected {} hex digits in the id, found {} characters", 2 * ID_LEN, hex.len()));
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
    Ok(IdFile { id, world_size, nonce })
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
pub fn write_id_file(path: &Path, file: &IdFile) -> Result<(), RendezvousError> {
    let name = path
        .file_name()
        .ok_or_else(|| RendezvousError::InvalidArgument(format!("id file path {} has no file name", path.display())))?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tmp = path.with_file_name(format!(".{}.tmp.{}.{nanos}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(RendezvousError::io(format!("creating {}", tmp.display())))?;
        f.write_all(encode_id_file(file).as_bytes())
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

/// What a reader makes of an id file.
enum FileState {
    /// This launch's id.
    Ready([u8; ID_LEN]),
    /// A valid id file of another launch (rank 0 may still replace it): why it is not ours.
    Stale(String),
    /// Not usable, and waiting will not help.
    Bad(RendezvousError),
}

fn classify_id_file(path: &Path, bytes: &[u8], world_size: usize, nonce: Option<u64>) -> FileState {
    let file = match decode_id_file(bytes) {
        Ok(file) => file,
        // Rank 0 always writes the current format: an older one is another launch's.
        Err(reason) if bytes.starts_with(FILE_HEADER_V1.as_bytes()) => return FileState::Stale(reason),
        Err(reason) => return FileState::Bad(RendezvousError::BadIdFile { path: path.to_path_buf(), reason }),
    };
    match nonce {
        Some(ours) if file.nonce != ours => FileState::Stale(format!(
            "it carries launch nonce {:016x}, this rank was given {ours:016x}: it belongs to another launch",
            file.nonce
        )),
        // Same launch, other world size: the ranks were started inconsistently.
        Some(_) if file.world_size != world_size => FileState::Bad(RendezvousError::WorldSizeMismatch {
            path: path.to_path_buf(),
            theirs: file.world_size,
            ours: world_size,
        }),
        None if file.world_size != world_size => FileState::Stale(format!(
            "it is for a world of {} ranks, this rank expects {world_size}: a file left by another launch, or ranks \
             started with different world sizes",
            file.world_size
        )),
        _ => FileState::Ready(file.id),
    }
}

/// Polls for this launch's id file until it appears (then decodes it) or `opts.timeout`
/// passes. A valid file of another launch (other nonce or world size, older format) is waited
/// past: rank 0 replaces it atomically; a foreign file is an error at once.
pub fn wait_id_file(path: &Path, world_size: usize, opts: &RendezvousOptions) -> Result<[u8; ID_LEN], RendezvousError> {
    let start = Instant::now();
    let mut stale: Option<String> = None;
    loop {
        match std::fs::read(path) {
            Ok(bytes) => match classify_id_file(path, &bytes, world_size, opts.nonce) {
                FileState::Ready(id) => return Ok(id),
                FileState::Bad(e) => return Err(e),
                FileState::Stale(why) => stale = Some(why),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RendezvousError::io(format!("reading {}", path.display()))(e)),
        }
        let waited = start.elapsed();
        if waited >= opts.timeout {
            let what = match stale {
                Some(why) => format!(
                    "waiting for rank 0 to replace the NCCL id file {}, which holds a stale id ({why}); is rank 0 \
                     running, with the same path and launch nonce?",
                    path.display()
                ),
                None => format!(
                    "waiting for rank 0 to write the NCCL id file {} (is rank 0 running, with the same path?)",
                    path.display()
                ),
            };
            return Err(RendezvousError::Timeout { what, waited });
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

    /// True once the server thread ended (then [`wait`](Self::wait) returns at once).
    pub fn is_done(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
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
        // Relaxed: the flag publishes no data, and a late read only delays the stop by a poll.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// What one connection to rank 0's server came to.
enum Outcome {
    /// The id was sent to this rank.
    Served(usize),
    /// A well-formed request that does not belong to this world (other world size, bad rank).
    Refused(String),
    /// Not a rendezvous request, or the connection failed.
    Bad(RendezvousError),
}

/// Counts a connection thread while it lives (also if it panics).
struct ConnectionSlot(Arc<AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        // Relaxed: the count only caps the number of threads; it publishes no data.
        self.0.fetch_sub(1, Ordering::Relaxed);
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
    let mut refused: Vec<String> = Vec::new();
    let (tx, rx) = mpsc::channel::<(SocketAddr, Outcome)>();
    let connections = Arc::new(AtomicUsize::new(0));
    loop {
        while let Ok((peer, outcome)) = rx.try_recv() {
            match outcome {
                Outcome::Served(rank) => {
                    served.insert(rank);
                }
                Outcome::Refused(reason) => {
                    tracing::warn!(%peer, %reason, "ferrum-nccl rendezvous: refused a request");
                    if refused.len() < 8 {
                        refused.push(format!("{peer}: {reason}"));
                    }
                }
                Outcome::Bad(e) => tracing::warn!(%peer, error = %e, "ferrum-nccl rendezvous: ignored a bad request"),
            }
        }
        if served.len() + 1 >= world_size {
            return Ok(());
        }
        // Relaxed: see TcpIdServer::drop.
        if stop.load(Ordering::Relaxed) {
            return Err(RendezvousError::Protocol { peer: "rank 0".into(), reason: "server stopped".into() });
        }
        let waited = start.elapsed();
        if waited >= opts.timeout {
            let missing: Vec<usize> = (1..world_size).filter(|r| !served.contains(r)).collect();
            let refusals =
                if refused.is_empty() { String::new() } else { format!("; refused: {}", refused.join("; ")) };
            return Err(RendezvousError::Timeout {
                what: format!(
                    "serving the NCCL id on {}: ranks {missing:?} of {world_size} never fetched it{refusals}",
                    listener.local_addr().map(|a| a.to_string()).unwrap_or_default()
                ),
                waited,
            });
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                // Relaxed: a cap on threads, publishing nothing (see ConnectionSlot).
                if connections.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                    tracing::warn!(%peer, "ferrum-nccl rendezvous: too many open connections, closed one");
                    continue;
                }
                connections.fetch_add(1, Ordering::Relaxed);
                let slot = ConnectionSlot(connections.clone());
                let tx = tx.clone();
                let remaining = opts.timeout - waited;
                let spawned = std::thread::Builder::new().name("ferrum-nccl-rdv-conn".into()).spawn(move || {
                    let _slot = slot;
                    let outcome = answer(stream, &id, world_size, remaining);
                    // The server may have ended meanwhile (then nobody listens): fine.
                    let _ = tx.send((peer, outcome));
                });
                if let Err(e) = spawned {
                    // The closure (and its slot) was dropped: the count is already given back.
                    tracing::warn!(%peer, error = %e, "ferrum-nccl rendezvous: could not spawn a connection thread");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(opts.poll_interval.min(Duration::from_millis(10)).max(Duration::from_millis(1)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RendezvousError::io("accepting a rendezvous connection")(e)),
        }
    }
}

/// Answers one connection (on its own thread): reads the request, sends the id or a refusal.
fn answer(mut stream: TcpStream, id: &[u8; ID_LEN], world_size: usize, remaining: Duration) -> Outcome {
    let io_timeout = Some(remaining.clamp(Duration::from_millis(100), REQUEST_TIMEOUT));
    let configured = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(io_timeout))
        .and_then(|()| stream.set_write_timeout(io_timeout));
    if let Err(e) = configured {
        return Outcome::Bad(RendezvousError::io("configuring a connection")(e));
    }
    let mut req = [0u8; 16];
    if let Err(e) = stream.read_exact(&mut req) {
        return Outcome::Bad(RendezvousError::io("reading a rendezvous request")(e));
    }
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    if &req[..8] != TCP_REQUEST {
        return Outcome::Bad(RendezvousError::Protocol { peer, reason: "not a ferrum-nccl rendezvous request".into() });
    }
    let rank = u32::from_le_bytes([req[8], req[9], req[10], req[11]]) as usize;
    let their_world = u32::from_le_bytes([req[12], req[13], req[14], req[15]]) as usize;
    let refusal = if their_world != world_size {
        Some(format!("rank 0 runs a world of {world_size} ranks, the request (rank {rank}) says {their_world}"))
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
        // Best effort: the refusal is also reported on this side (logged, and named in the
        // server's timeout error).
        let _ = stream.write_all(&msg);
        return Outcome::Refused(reason);
    }
    let mut msg = [0u8; 8 + ID_LEN];
    msg[..8].copy_from_slice(TCP_ID);
    msg[8..].copy_from_slice(id);
    match stream.write_all(&msg).and_then(|()| stream.flush()) {
        Ok(()) => Outcome::Served(rank),
        Err(e) => Outcome::Bad(RendezvousError::io(format!("sending the id to rank {rank}"))(e)),
    }
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

/// One attempt: resolve `addr` and try each of its addresses in turn.
fn try_fetch(addr: &str, rank: usize, world_size: usize, remaining: Duration) -> Result<[u8; ID_LEN], Attempt> {
    let addrs: Vec<SocketAddr> = match addr.to_socket_addrs() {
        Ok(a) => a.collect(),
        // A malformed address (bad port, no port) never becomes valid: stop now.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
            return Err(Attempt::Fatal(RendezvousError::InvalidArgument(format!("rendezvous address `{addr}`: {e}"))));
        }
        // DNS may not be up yet on a fresh node: retry.
        Err(e) => return Err(Attempt::Retry(format!("resolving {addr}: {e}"))),
    };
    if addrs.is_empty() {
        return Err(Attempt::Fatal(RendezvousError::InvalidArgument(format!("{addr} resolves to no address"))));
    }
    if addrs.iter().all(|a| a.port() == 0) {
        return Err(Attempt::Fatal(RendezvousError::InvalidArgument(format!(
            "rendezvous address `{addr}` has port 0: only rank 0 can use it (to bind a free port); the other ranks \
             need the real port"
        ))));
    }
    let per_address = (remaining / addrs.len() as u32).clamp(Duration::from_millis(10), Duration::from_secs(10));
    let mut errors = Vec::new();
    let mut foreign = None;
    for sock in &addrs {
        match exchange(sock, rank, world_size, per_address) {
            Ok(id) => return Ok(id),
            Err(Exchange::Refused(e)) => return Err(Attempt::Fatal(e)),
            Err(Exchange::Foreign(e)) => {
                errors.push(format!("{sock}: {e}"));
                foreign.get_or_insert(e);
            }
            Err(Exchange::Failed(msg)) => errors.push(format!("{sock}: {msg}")),
        }
    }
    // Some other service answered and rank 0 was at none of the addresses: that will not change.
    match foreign {
        Some(e) => Err(Attempt::Fatal(e)),
        None => Err(Attempt::Retry(errors.join("; "))),
    }
}

/// Why one address did not give the id.
enum Exchange {
    /// Rank 0 refused the request (world size or rank mismatch).
    Refused(RendezvousError),
    /// Something else than a rendezvous server answered.
    Foreign(RendezvousError),
    /// No connection, or it broke: worth retrying.
    Failed(String),
}

fn exchange(sock: &SocketAddr, rank: usize, world_size: usize, io_timeout: Duration) -> Result<[u8; ID_LEN], Exchange> {
    let failed = |e: std::io::Error| Exchange::Failed(e.to_string());
    let mut stream = TcpStream::connect_timeout(sock, io_timeout).map_err(failed)?;
    stream.set_read_timeout(Some(io_timeout)).map_err(failed)?;
    stream.set_write_timeout(Some(io_timeout)).map_err(failed)?;
    let mut req = [0u8; 16];
    req[..8].copy_from_slice(TCP_REQUEST);
    req[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    req[12..].copy_from_slice(&(world_size as u32).to_le_bytes());
    stream.write_all(&req).map_err(failed)?;
    let mut tag = [0u8; 8];
    stream.read_exact(&mut tag).map_err(failed)?;
    let peer = sock.to_string();
    if &tag == TCP_ID {
        let mut id = [0u8; ID_LEN];
        stream.read_exact(&mut id).map_err(failed)?;
        Ok(id)
    } else if &tag == TCP_ERR {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(failed)?;
        let len = u32::from_le_bytes(len).min(MAX_ERR_LEN) as usize;
        let mut text = vec![0u8; len];
        stream.read_exact(&mut text).map_err(failed)?;
        Err(Exchange::Refused(RendezvousError::Protocol {
            peer,
            reason: format!("rank 0 refused: {}", String::from_utf8_lossy(&text)),
        }))
    } else {
        Err(Exchange::Foreign(RendezvousError::Protocol {
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
        RendezvousOptions { timeout: Duration::from_millis(300), poll_interval: Duration::from_millis(5), nonce: None }
    }

    fn opts(timeout_ms: u64, nonce: Option<u64>) -> RendezvousOptions {
        RendezvousOptions { timeout: Duration::from_millis(timeout_ms), poll_interval: Duration::from_millis(5), nonce }
    }

    fn file(seed: u8, world_size: usize, nonce: u64) -> IdFile {
        IdFile { id: id(seed), world_size, nonce }
    }

    #[test]
    fn id_file_round_trip() {
        for seed in 0..8 {
            let f = file(seed, usize::from(seed) + 1, u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            assert_eq!(decode_id_file(encode_id_file(&f).as_bytes()).unwrap(), f);
        }
        // Upper-case hex and a missing final newline are accepted.
        let f = file(3, 2, 0xabcdef);
        let text = encode_id_file(&f);
        let (head, hex) = text.rsplit_once("id=").unwrap();
        let upper = format!("{head}id={}", hex.trim_end().to_uppercase());
        assert_eq!(decode_id_file(upper.as_bytes()).unwrap(), f);
        assert!(text.starts_with("ferrum-nccl-id v2 world=2 nonce=0000000000abcdef id="), "{text}");
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
        // Two publications without a nonce get different random ones.
        let a = decode_id_file(&std::fs::read(&path).unwrap()).unwrap().nonce;
        rdv.publish(&y, 4, &quick()).unwrap();
        let b = decode_id_file(&std::fs::read(&path).unwrap()).unwrap().nonce;
        assert_ne!(a, b);
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
                write_id_file(&path, &IdFile { id: x, world_size: 2, nonce: 1 }).unwrap();
            })
        };
        assert_eq!(Rendezvous::File(path).fetch(1, 2, &opts(10_000, None)).unwrap(), x);
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
        let good = encode_id_file(&file(0, 2, 5));
        let at = good.find("id=").unwrap() + 3;
        let mut nonhex = good.clone();
        nonhex.replace_range(at..at + 2, "zz");
        let cases: [(&str, Vec<u8>); 8] = [
            ("binary", vec![0u8, 159, 146, 150, 255]),
            ("other", b"hello world\n".to_vec()),
            ("short", b"ferrum-nccl-id v2 world=2 nonce=0000000000000005 id=abcd\n".to_vec()),
            ("nonhex", nonhex.into_bytes()),
            ("raw-128-bytes", id(1).to_vec()),
            ("no-world", good.replace("world=2 ", "").into_bytes()),
            ("zero-world", good.replace("world=2", "world=0").into_bytes()),
            ("bad-nonce", good.replace("nonce=0000000000000005", "nonce=5").into_bytes()),
        ];
        for (name, content) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            let t = Instant::now();
            let err = Rendezvous::File(path).fetch(1, 2, &opts(5_000, None)).unwrap_err();
            // At once: waiting would not help.
            assert!(t.elapsed() < Duration::from_secs(2), "{name}");
            let msg = err.to_string();
            assert!(matches!(err, RendezvousError::BadIdFile { .. }), "{name}: {msg}");
            assert!(msg.contains("not a valid ferrum-nccl id file"), "{msg}");
            println!("{name}: {msg}");
        }
    }

    #[test]
    fn stale_id_file_is_waited_past_until_rank0_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("reused.id");
        // Left by an earlier launch (nonce 1); this launch's nonce is 2.
        write_id_file(&path, &file(1, 2, 1)).unwrap();
        let writer = {
            let path = path.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(150));
                Rendezvous::File(path).publish(&id(2), 2, &opts(1_000, Some(2))).unwrap().finish().unwrap();
            })
        };
        assert_eq!(Rendezvous::File(path).fetch(1, 2, &opts(10_000, Some(2))).unwrap(), id(2));
        writer.join().unwrap();
    }

    #[test]
    fn stale_id_file_times_out_naming_why() {
        let dir = tempfile::tempdir().unwrap();
        let cases: [(&str, String, RendezvousOptions, &str); 3] = [
            ("other-nonce", encode_id_file(&file(1, 2, 0x11)), opts(200, Some(0x22)), "launch nonce 0000000000000011"),
            ("other-world", encode_id_file(&file(1, 4, 0x11)), opts(200, None), "world of 4 ranks"),
            ("format-v1", format!("ferrum-nccl-id v1 {}\n", "ab".repeat(ID_LEN)), opts(200, None), "format v1"),
        ];
        for (name, content, o, want) in cases {
            let path = dir.path().join(name);
            std::fs::write(&path, content).unwrap();
            let err = Rendezvous::File(path).fetch(1, 2, &o).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, RendezvousError::Timeout { .. }), "{name}: {msg}");
            assert!(msg.contains("stale") && msg.contains(want), "{name}: {msg}");
            println!("{name}: {msg}");
        }
    }

    #[test]
    fn world_size_mismatch_within_a_launch_is_an_error_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mismatch.id");
        write_id_file(&path, &file(1, 4, 7)).unwrap();
        let t = Instant::now();
        let err = Rendezvous::File(path).fetch(1, 2, &opts(10_000, Some(7))).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2));
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::WorldSizeMismatch { theirs: 4, ours: 2, .. }), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn tcp_serves_every_rank() {
        let world = 4;
        let x = id(9);
        let opts = opts(20_000, None);
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, world, &opts).unwrap();
        assert!(!publication.is_done());
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
        // The server ends on its own once every rank was served.
        let t = Instant::now();
        while !publication.is_done() {
            assert!(t.elapsed() < Duration::from_secs(5), "the server did not end");
            std::thread::sleep(Duration::from_millis(5));
        }
        publication.finish().unwrap();
    }

    #[test]
    fn tcp_client_retries_until_the_server_is_up() {
        // Reserve a free port, release it, and start the server on it a little later.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let x = id(4);
        let opts = opts(20_000, None);
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
    fn tcp_world_size_mismatch_is_refused_and_reported_by_the_server() {
        let x = id(6);
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 2, &opts(1_000, None)).unwrap();
        let addr = publication.local_addr().unwrap().to_string();
        let err = Rendezvous::Tcp(addr).fetch(1, 3, &opts(5_000, None)).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Protocol { .. }), "{msg}");
        assert!(msg.contains("world of 2"), "{msg}");
        // Rank 0 names the refusal when it gives up.
        let err = publication.finish().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{msg}");
        assert!(msg.contains("ranks [1] of 2") && msg.contains("refused") && msg.contains("says 3"), "{msg}");
        println!("{msg}");
    }

    #[test]
    fn tcp_silent_connections_do_not_stall_the_server() {
        let x = id(8);
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 2, &opts(20_000, None)).unwrap();
        let addr = publication.local_addr().unwrap();
        // Peers that connect and never send a request (a port scanner, a hung process).
        let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(50));
        let t = Instant::now();
        assert_eq!(Rendezvous::Tcp(addr.to_string()).fetch(1, 2, &opts(20_000, None)).unwrap(), x);
        // A serial server would have waited for each silent peer's request timeout first.
        assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
        publication.finish().unwrap();
        drop(silent);
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
    fn tcp_malformed_address_fails_at_once() {
        // Bypasses `parse` (which refuses them): `fetch` must not mistake them for DNS delays.
        for addr in ["127.0.0.1:abc", "127.0.0.1", "127.0.0.1:0"] {
            let t = Instant::now();
            let err = Rendezvous::Tcp(addr.into()).fetch(1, 2, &opts(20_000, None)).unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(2), "{addr}: took {:?}", t.elapsed());
            assert!(matches!(err, RendezvousError::InvalidArgument(_)), "{addr}: {err}");
            println!("{addr}: {err}");
        }
    }

    #[test]
    fn tcp_client_tries_every_resolved_address() {
        let x = id(10);
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 2, &opts(20_000, None)).unwrap();
        let port = publication.local_addr().unwrap().port();
        // A dead address first, the server second.
        let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let addrs = [dead, SocketAddr::from(([127, 0, 0, 1], port))];
        assert_eq!(try_fetch_from(&addrs, 1, 2).unwrap(), x);
        publication.finish().unwrap();
        // "localhost" may resolve to ::1 first; the server listens on 127.0.0.1 only.
        let publication = Rendezvous::Tcp("127.0.0.1:0".into()).publish(&x, 2, &opts(20_000, None)).unwrap();
        let port = publication.local_addr().unwrap().port();
        assert_eq!(Rendezvous::Tcp(format!("localhost:{port}")).fetch(1, 2, &opts(20_000, None)).unwrap(), x);
        publication.finish().unwrap();
    }

    /// `try_fetch`'s loop over addresses, on given addresses.
    fn try_fetch_from(addrs: &[SocketAddr], rank: usize, world: usize) -> Result<[u8; ID_LEN], String> {
        let mut errors = Vec::new();
        for sock in addrs {
            match exchange(sock, rank, world, Duration::from_secs(5)) {
                Ok(id) => return Ok(id),
                Err(Exchange::Refused(e) | Exchange::Foreign(e)) => return Err(e.to_string()),
                Err(Exchange::Failed(m)) => errors.push(m),
            }
        }
        Err(errors.join("; "))
    }

    #[test]
    fn parse_checks_the_address() {
        assert_eq!(Rendezvous::parse("file:/x/y.id").unwrap(), Rendezvous::File("/x/y.id".into()));
        assert_eq!(Rendezvous::parse("tcp:10.0.0.1:29500").unwrap(), Rendezvous::Tcp("10.0.0.1:29500".into()));
        assert_eq!(Rendezvous::parse("tcp:node-7:1").unwrap(), Rendezvous::Tcp("node-7:1".into()));
        assert_eq!(Rendezvous::parse("tcp:[::1]:29500").unwrap(), Rendezvous::Tcp("[::1]:29500".into()));
        assert_eq!(Rendezvous::parse("tcp:127.0.0.1:0").unwrap(), Rendezvous::Tcp("127.0.0.1:0".into()));
        for bad in [
            "udp:1.2.3.4:5",
            "file:",
            "tcp:localhost",
            "tcp:host:abc",
            "tcp:host:",
            "tcp:host:65536",
            "tcp:host:-1",
            "tcp::29500",
            "tcp:::1:29500",
            "tcp:host:29500 ",
        ] {
            let err = Rendezvous::parse(bad).unwrap_err();
            assert!(matches!(err, RendezvousError::InvalidArgument(_)), "{bad}: {err}");
            println!("{bad}: {err}");
        }
    }

    #[test]
    fn bad_arguments() {
        let r = Rendezvous::Tcp("127.0.0.1:1".into());
        assert!(matches!(r.fetch(0, 2, &quick()), Err(RendezvousError::InvalidArgument(_))));
        assert!(matches!(r.fetch(2, 2, &quick()), Err(RendezvousError::InvalidArgument(_))));
        assert!(matches!(r.publish(&id(0), 0, &quick()), Err(RendezvousError::InvalidArgument(_))));
    }
}
