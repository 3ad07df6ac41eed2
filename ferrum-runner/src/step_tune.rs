//! Step-level tuning of the GEMV launch variants: which variant each projection shape
//! launches, chosen by timing the whole captured decode step rather than each GEMV alone.
//!
//! ferrum-cuda's start-up tuning times every shape's launch variants one GEMV at a time (a
//! chain of that shape, the L2 flushed). At small models the step is a chain of ~1 µs kernels
//! that overlap at their boundaries (programmatic dependent launch), and a variant's cost there
//! is not its cost alone. Measured on one H200 (session 37, `docs/PERF.md`): SmolLM2-135M's
//! q/k/v projection as 480 blocks of 96 threads (variant 1) times within the start-up tuning's
//! tie margin of its 240-block launch in some processes, and a process that took it stepped in
//! 381.6 µs against 362.3 with the other (the bimodal processes of sessions 15-29); the step
//! tuning measured both and moved it back. The variants give bit-identical results, so the
//! choice is speed only, and the step itself is the measure that counts.
//!
//! [`coordinate_descent`] is the search (one pass over the shapes, each shape's candidates
//! timed with the others fixed, a change kept only when it beats the best so far by more than
//! a margin); the CUDA backend supplies the timing (`CudaBackend::tune_step`, greedy steps over
//! the [`TUNE_WINDOWS`] of a [`TUNE_CAPACITY`]-row sequence) and runs it at its first prefill.
//! Whether it runs is `FERRUM_STEP_TUNE` ([`StepTune::from_env`]); its results are kept between
//! processes ([`TuneCache`], `FERRUM_STEP_TUNE_CACHE`); `FERRUM_STEP_TUNE_WINDOW`
//! ([`tune_windows`]) and `FERRUM_GEMV_SET` ([`gemv_set`]) are measurement knobs.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `FERRUM_STEP_TUNE`: whether a one-GPU CUDA backend tunes its GEMV variants on the whole
/// step, once, before its first prefill (`DecodeBackend::prepare`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepTune {
    /// `0`: keep the start-up tuning's choices.
    Off,
    /// `auto` (unset): tune when one step is short ([`AUTO_MAX_STEP_S`]): there kernel
    /// boundaries are a large share of the step; an earlier tuning's cached result is taken
    /// instead when there is one ([`TuneCache`]; a step cached as too long to tune skips the
    /// probe too: [`CacheEntry::usable`]). A tuning error is then a warning and the start-up
    /// choices stay.
    Auto,
    /// `1`: tune whatever the step's length and whatever is cached; a tuning error is the
    /// error of the prefill that runs it.
    On,
}

/// Under [`StepTune::Auto`], the longest step (seconds) that is tuned. Measured on one H200
/// (session 37): SmolLM2-135M's step (~0.37 ms) is where the start-up tuning's per-GEMV timing
/// misjudged a launch (the qkv flip, 381.6 -> 362.3 µs a step), and its tuning takes ~1.8 s
/// (four windows, session 38) where the screened head's step gains 0.6-1%; Llama-3.2-1B's (~0.73 ms) kept every start-up choice in each of its tunings and took
/// 1.6 s (session 37) — until the o projection's early trigger (session 47): then one
/// process in six took that projection as 4-row warps at start-up (timed 3.498 µs alone
/// against 3.43–3.45 for the 2-row ones) and ran 1460.8 tok/s against 1488.9–1493.7, and
/// the step tuning corrected it where it ran (683.5 -> 669.4 µs a step; six processes tuned
/// with `FERRUM_STEP_TUNE=1` ran 1491.3–1493.7), so the limit went from 0.5 to 1 ms;
/// Llama-3-8B's (~3.7 ms) is weight streaming, where the per-GEMV timing is what the step
/// sees.
pub const AUTO_MAX_STEP_S: f64 = 1.0e-3;

/// The tuning sequence's prompt (tokens) and KV capacity (rows): the shape of issue 6's
/// benchmark (a 128-token prompt, 256 new tokens). The attention's split count follows the
/// capacity and its length the position, and both change how the GEMVs around it overlap.
pub const TUNE_PROMPT: usize = 128;
pub const TUNE_CAPACITY: usize = 384;

/// Steps of the tuning's first measurement, from [`TUNE_PROMPT`], which decides whether the
/// step is short enough to tune ([`StepTune::wants`]): a long step's model is not tuned and
/// should not pay for the passes over the windows (at Llama-3-8B's ~3.7 ms, 2 × 8 steps).
pub const TUNE_PROBE_STEPS: usize = 8;

/// The default timed windows `(first position, steps)`: four spread over the benchmark's
/// positions 128-384, so that a measurement sees short and long attention alike. Session 37's
/// one window (positions 128-160) timed SmolLM2-135M's gate|up as 4-row warps 0.3% slower,
/// while over 128-384 it ran ~1% faster (separate processes, `FERRUM_GEMV_SET`).
pub const TUNE_WINDOWS: [(usize, usize); 4] = [(128, 16), (208, 16), (288, 16), (368, 16)];

/// Timed measurements per setting; their median counts.
pub const TUNE_REPS: usize = 3;

/// A candidate replaces the best setting so far only when its step is faster by more than this
/// fraction: below it, the difference is within the measurement's noise, and the start-up
/// choice (measured first) stays.
pub const TUNE_MARGIN: f64 = 0.003;

impl StepTune {
    /// Parses `FERRUM_STEP_TUNE`'s value (`None`: unset).
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("auto") => Ok(StepTune::Auto),
            Some("0") => Ok(StepTune::Off),
            Some("1") => Ok(StepTune::On),
            Some(v) => Err(Error::InvalidInput(format!("FERRUM_STEP_TUNE={v:?}: expected 0, 1 or auto"))),
        }
    }

    /// Reads `FERRUM_STEP_TUNE` from the environment.
    pub fn from_env() -> Result<Self> {
        Self::parse(std::env::var("FERRUM_STEP_TUNE").ok().as_deref())
    }

    /// Whether tuning errors are the caller's (`On`) rather than warnings (`Auto`).
    pub fn strict(self) -> bool {
        self == StepTune::On
    }

    /// Whether to tune a model whose step (with the start-up choices) takes `step_s` seconds.
    pub fn wants(self, step_s: f64) -> bool {
        match self {
            StepTune::Off => false,
            StepTune::Auto => step_s <= AUTO_MAX_STEP_S,
            StepTune::On => true,
        }
    }
}

/// One shape's decision: its variant before and after, and the step time (seconds a
/// measurement) with each.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeChoice {
    /// The shape's index in the list given to [`coordinate_descent`].
    pub shape: usize,
    pub from: usize,
    pub to: usize,
    /// Every candidate timed for this shape, `(variant, seconds)`, in the order timed.
    pub timed: Vec<(usize, f64)>,
}

/// A GEMV shape as ferrum-cuda keys it: `(rows, cols, gate|up)`.
pub type GemvKey = (usize, usize, bool);

/// `FERRUM_GEMV_SET` (`None`: unset, nothing): launch variants for single GEMV shapes, set when
/// the backend opens and left alone by the tuning, as `ROWSxCOLS=V` entries separated by commas, a `g` after COLS for the stacked
/// gate|up (`960x576=0,1536x576g=3`; rows count outputs, as the `step tuning` log lines do),
/// `V` a variant index. A measurement knob: each shape must be one the runner launches and `V`
/// one of its candidates (ferrum-cuda's `set_gemv_variant` checks; results stay bit-identical).
pub fn gemv_set(value: Option<&str>) -> Result<Vec<(GemvKey, usize)>> {
    let Some(v) = value else { return Ok(Vec::new()) };
    let bad = |e: &str| {
        Error::InvalidInput(format!("FERRUM_GEMV_SET={v:?}: {e} (expected ROWSxCOLS[g]=V entries separated by commas)"))
    };
    let mut out = Vec::new();
    for entry in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (shape, var) = entry.split_once('=').ok_or_else(|| bad(&format!("{entry:?} has no '='")))?;
        let (rows, cols) = shape.split_once('x').ok_or_else(|| bad(&format!("{shape:?} has no 'x'")))?;
        let (cols, gateup) = match cols.trim().strip_suffix('g') {
            Some(c) => (c, true),
            None => (cols, false),
        };
        let num = |t: &str| t.trim().parse::<usize>().ok();
        let (Some(rows), Some(cols), Some(var)) = (num(rows), num(cols), num(var)) else {
            return Err(bad(&format!("{entry:?} is not three numbers")));
        };
        out.push(((rows, cols, gateup), var));
    }
    Ok(out)
}

/// `FERRUM_STEP_TUNE_WINDOW` (`None`: unset, [`TUNE_WINDOWS`]): the positions a step-level
/// tuning times, as `FIRST+STEPS` entries separated by commas (`128+32`: positions 128-160).
/// A measurement knob: each window must lie in the tuning sequence, from [`TUNE_PROMPT`] to
/// [`TUNE_CAPACITY`].
pub fn tune_windows(value: Option<&str>) -> Result<Vec<(usize, usize)>> {
    let Some(v) = value else { return Ok(TUNE_WINDOWS.to_vec()) };
    let bad = |e: &str| {
        Error::InvalidInput(format!(
            "FERRUM_STEP_TUNE_WINDOW={v:?}: {e} (expected FIRST+STEPS entries separated by commas, within \
             positions {TUNE_PROMPT}..={TUNE_CAPACITY})"
        ))
    };
    let mut out = Vec::new();
    for entry in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let num = |t: &str| t.trim().parse::<usize>().ok();
        let Some((Some(first), Some(steps))) = entry.split_once('+').map(|(a, b)| (num(a), num(b))) else {
            return Err(bad(&format!("{entry:?} is not FIRST+STEPS")));
        };
        if steps == 0 || first < TUNE_PROMPT || first.checked_add(steps).is_none_or(|e| e > TUNE_CAPACITY) {
            return Err(bad(&format!("{entry:?} is empty or outside the tuning sequence")));
        }
        out.push((first, steps));
    }
    if out.is_empty() {
        return Err(bad("no window"));
    }
    Ok(out)
}

/// The file, in the cache folder (`FERRUM_CACHE`, else `~/.cache/ferrum`), where step tunings
/// are kept between processes ([`TuneCache`]).
pub const CACHE_FILE: &str = "step-tune-v1.json";

/// Entries a [`TuneCache`] keeps; beyond it the oldest go.
pub const CACHE_MAX_ENTRIES: usize = 64;

/// A step tuning's result as the cache keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheEntry {
    /// What the tuning ran on, in words (the key is its hash): the kernels' build, the GPU,
    /// the model's shapes, the step's options and the `FERRUM_*` settings.
    pub about: String,
    /// The searched shapes' variants, `(rows, cols, gate|up, variant)`; none when the step was
    /// too long to search ([`StepTuneReport::searched`]).
    pub variants: Vec<(usize, usize, bool, usize)>,
    /// The tuned step, µs (as the tuning measured it); for an entry without variants, the
    /// probe's step (one short pass, untuned).
    pub step_us: f64,
    /// When it was stored (seconds since the Unix epoch): the oldest entries go first.
    pub stored: u64,
}

#[derive(Default, Serialize, Deserialize)]
struct CacheFileV1 {
    entries: BTreeMap<String, CacheEntry>,
}

/// Step tunings kept between processes (`FERRUM_STEP_TUNE_CACHE`; [`TuneCache::from_env`]),
/// so that only a model's first run on a GPU and a build pays for the tuning (~1.8 s at
/// SmolLM2-135M). A choice is speed only (the variants are bit-identical), so a stale or
/// missing entry costs time, never a result: a cache that cannot be read or written is a
/// warning, not an error. Writes go to a temporary file renamed over the old one, so a reader
/// never sees half a file and concurrent writers lose at most each other's entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TuneCache {
    path: PathBuf,
}

impl TuneCache {
    /// A cache in the file `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `FERRUM_STEP_TUNE_CACHE`'s value (`None`: unset) as a cache: unset, [`CACHE_FILE`] in
    /// `cache_dir` (none if there is no cache folder); `0`, none; otherwise the file it names.
    pub fn parse(value: Option<&str>, cache_dir: Option<PathBuf>) -> Option<Self> {
        match value.map(str::trim) {
            Some("0") => None,
            Some(p) if !p.is_empty() => Some(Self::new(p)),
            _ => cache_dir.map(|d| Self::new(d.join(CACHE_FILE))),
        }
    }

    /// The cache `FERRUM_STEP_TUNE_CACHE` and `FERRUM_CACHE` name ([`parse`](Self::parse)).
    pub fn from_env() -> Option<Self> {
        Self::parse(std::env::var("FERRUM_STEP_TUNE_CACHE").ok().as_deref(), crate::fetch::cache_dir().ok())
    }

    /// The key of the tuning `about` describes: its SHA-256, hex.
    pub fn key(about: &str) -> String {
        Sha256::digest(about.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn read(&self) -> Result<CacheFileV1> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
                path: self.path.clone(),
                detail: format!("not a step tuning cache: {e}"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(CacheFileV1::default()),
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// The entry stored for `about`, if any. An unreadable file is `Err` (the caller warns);
    /// an entry whose description differs (a hash collision) is none.
    pub fn get(&self, about: &str) -> Result<Option<CacheEntry>> {
        Ok(self.read()?.entries.remove(&Self::key(about)).filter(|e| e.about == about))
    }

    /// Stores `entry` (under its description's key), keeping the newest
    /// [`CACHE_MAX_ENTRIES`]. A file that cannot be parsed is replaced.
    pub fn put(&self, entry: CacheEntry) -> Result<()> {
        let mut file = self.read().unwrap_or_default();
        file.entries.insert(Self::key(&entry.about), entry);
        while file.entries.len() > CACHE_MAX_ENTRIES {
            let oldest = file.entries.iter().min_by_key(|(_, e)| e.stored).map(|(k, _)| k.clone());
            oldest.and_then(|k| file.entries.remove(&k));
        }
        let json = serde_json::to_vec_pretty(&file)
            .map_err(|e| Error::Corrupt { path: self.path.clone(), detail: format!("serialising: {e}") })?;
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(format!(".tmp{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, json).and_then(|()| std::fs::rename(&tmp, &self.path)).map_err(|e| {
            // Best effort: the temporary file may not even exist.
            let _ = std::fs::remove_file(&tmp);
            Error::io(&self.path, e)
        })
    }
}

/// What a step-level tuning did (`CudaBackend::tune_step`).
#[derive(Clone, Debug, PartialEq)]
pub struct StepTuneReport {
    /// One step's time (seconds) with the start-up choices, and with the tuned ones.
    pub first_step_s: f64,
    pub best_step_s: f64,
    /// Each searched shape `(rows, cols, gate|up)` and its decision.
    pub shapes: Vec<(GemvKey, ShapeChoice)>,
    /// Whether the shapes were searched: false when the probe's step was too long for the
    /// mode ([`StepTune::wants`]); then `shapes` is empty and both step times are the probe's.
    pub searched: bool,
    /// Wall time the tuning took, seconds.
    pub wall_s: f64,
}

/// How many times [`AUTO_MAX_STEP_S`] a probed step must take for the cache to keep "too long
/// to tune" ([`CacheEntry::from_report`]): one probe is a single short pass, and a process
/// whose GPU was busy or slowed (a profiler, another process) must not switch `auto` off for
/// later ones; a step nearer the limit is probed again each time (a prefill and 16 steps).
pub const CACHE_LONG_FACTOR: f64 = 2.0;

impl CacheEntry {
    /// The entry that keeps `r` for the tuning `about` describes, stored at `stored` (seconds
    /// since the Unix epoch): its shapes' chosen variants and its tuned step; when nothing was
    /// searched (the probe's step too long), an entry without variants, so that a later
    /// process skips the probe too, but only for a step over [`CACHE_LONG_FACTOR`] times
    /// [`AUTO_MAX_STEP_S`] (else `None`: nothing to keep).
    pub fn from_report(about: String, r: &StepTuneReport, stored: u64) -> Option<Self> {
        if !r.searched && r.first_step_s <= CACHE_LONG_FACTOR * AUTO_MAX_STEP_S {
            return None;
        }
        Some(CacheEntry {
            about,
            variants: r.shapes.iter().map(|(k, c)| (k.0, k.1, k.2, c.to)).collect(),
            step_us: r.best_step_s * 1e6,
            stored,
        })
    }

    /// Whether `auto` may take this entry instead of tuning: one with variants always; one
    /// without (a step too long to tune) only while `auto` would still not tune its step.
    pub fn usable(&self) -> bool {
        !self.variants.is_empty() || !StepTune::Auto.wants(self.step_us * 1e-6)
    }
}

/// The median of `xs` (the upper one of an even count); `NaN` for none.
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// One pass of coordinate descent over `shapes` (each `(variant now, candidates)`), starting
/// from `first`, the step's measurement with the current settings: shape by shape, the step
/// is measured with each other candidate of that shape (the other shapes at their best so
/// far); a candidate is kept when its measurement beats the best by more than `margin` (a
/// fraction). `set(shape, variant)` sets a shape's variant; `measure()` times the step with the
/// settings made so far. Every shape ends at its best candidate (set again where the last one
/// timed was not it). Returns the last best and each shape's decision. A shape whose only
/// candidate is its variant now is skipped; an error from `set` or `measure` stops the search
/// at once and is returned (the settings may then be any of the candidates, all valid).
pub fn coordinate_descent(
    shapes: &[(usize, Vec<usize>)],
    margin: f64,
    first: f64,
    set: &mut dyn FnMut(usize, usize) -> Result<()>,
    measure: &mut dyn FnMut() -> Result<f64>,
) -> Result<(f64, Vec<ShapeChoice>)> {
    let mut best = first;
    let mut choices = Vec::new();
    for (i, (now, candidates)) in shapes.iter().enumerate() {
        if candidates.iter().all(|c| c == now) {
            continue;
        }
        let mut pick = *now;
        let mut timed = vec![(*now, best)];
        for &c in candidates.iter().filter(|&&c| c != *now) {
            set(i, c)?;
            let t = measure()?;
            timed.push((c, t));
            if t < best * (1.0 - margin) {
                best = t;
                pick = c;
            }
        }
        if timed.last().map(|t| t.0) != Some(pick) {
            set(i, pick)?;
        }
        choices.push(ShapeChoice { shape: i, from: *now, to: pick, timed });
    }
    Ok((best, choices))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_knob_parses_three_values_and_names_itself_otherwise() {
        assert_eq!(StepTune::parse(None).unwrap(), StepTune::Auto);
        assert_eq!(StepTune::parse(Some(" auto ")).unwrap(), StepTune::Auto);
        assert_eq!(StepTune::parse(Some("0")).unwrap(), StepTune::Off);
        assert_eq!(StepTune::parse(Some("1")).unwrap(), StepTune::On);
        for bad in ["", "2", "yes", "on"] {
            let e = StepTune::parse(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_STEP_TUNE"), "{bad:?}: {e}");
        }
        assert!(StepTune::Auto.wants(AUTO_MAX_STEP_S) && !StepTune::Auto.wants(AUTO_MAX_STEP_S * 1.01));
        assert!(StepTune::On.wants(1.0) && !StepTune::Off.wants(0.0));
        assert!(StepTune::On.strict() && !StepTune::Auto.strict());
    }

    #[test]
    fn windows_parse_lie_in_the_tuning_sequence_and_name_the_knob_otherwise() {
        assert_eq!(tune_windows(None).unwrap(), TUNE_WINDOWS.to_vec());
        for &(first, steps) in &TUNE_WINDOWS {
            assert!(first >= TUNE_PROMPT && first + steps <= TUNE_CAPACITY);
        }
        assert_eq!(tune_windows(Some(" 128+32, 352+32 ,")).unwrap(), vec![(128, 32), (352, 32)]);
        for bad in ["", ",", "128", "128+0", "127+1", "380+5", "a+1", "128+-1", "128+99999999999999999999"] {
            let e = tune_windows(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_STEP_TUNE_WINDOW"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn shape_settings_parse_and_name_the_knob_when_malformed() {
        assert_eq!(gemv_set(None).unwrap(), vec![]);
        assert_eq!(
            gemv_set(Some(" 960x576=0, 1536x576g=3 ,")).unwrap(),
            vec![((960, 576, false), 0), ((1536, 576, true), 3)]
        );
        for bad in ["960x576", "960=1", "ax576=1", "960x576=-1", "960x576h=1"] {
            let e = gemv_set(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("FERRUM_GEMV_SET"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn only_a_step_clearly_too_long_is_cached_as_such_and_auto_reconsiders_others() {
        let report = |step_s: f64, searched: bool| StepTuneReport {
            first_step_s: step_s,
            best_step_s: step_s,
            shapes: if searched { vec![((576, 576, false), choice())] } else { vec![] },
            searched,
            wall_s: 0.1,
        };
        let limit = CACHE_LONG_FACTOR * AUTO_MAX_STEP_S;
        // Not searched: kept only past the factor (a noisy probe near the limit keeps nothing).
        assert_eq!(CacheEntry::from_report("a".into(), &report(limit, false), 1), None);
        assert_eq!(CacheEntry::from_report("a".into(), &report(AUTO_MAX_STEP_S * 1.1, false), 1), None);
        let long = CacheEntry::from_report("a".into(), &report(limit * 1.5, false), 1).unwrap();
        assert!(long.variants.is_empty() && long.usable());
        // Searched: kept whatever the step, with its variants.
        let tuned = CacheEntry::from_report("a".into(), &report(AUTO_MAX_STEP_S / 2.0, true), 1).unwrap();
        assert_eq!(tuned.variants, vec![(576, 576, false, 1)]);
        assert!(tuned.usable());
        // An entry without variants whose step auto would tune (an older limit, or a hand
        // edit) is not taken: auto probes again.
        let stale = CacheEntry { step_us: AUTO_MAX_STEP_S * 1e6 / 2.0, ..long };
        assert!(!stale.usable());
    }

    fn choice() -> ShapeChoice {
        ShapeChoice { shape: 0, from: 0, to: 1, timed: vec![(0, 1.0), (1, 0.9)] }
    }

    fn entry(about: &str, stored: u64) -> CacheEntry {
        CacheEntry { about: about.into(), variants: vec![(1536, 576, true, 3)], step_us: 375.7, stored }
    }

    #[test]
    fn the_cache_keeps_entries_by_description_and_survives_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(TuneCache::parse(Some("0"), Some(dir.path().into())), None);
        assert_eq!(TuneCache::parse(None, None), None);
        assert_eq!(TuneCache::parse(Some(" "), Some(dir.path().into())).unwrap().path(), dir.path().join(CACHE_FILE));
        assert_eq!(TuneCache::parse(Some("/x/t.json"), None).unwrap().path(), Path::new("/x/t.json"));
        let c = TuneCache::new(dir.path().join("sub").join(CACHE_FILE));
        // Missing file: nothing cached; a put creates the folder.
        assert_eq!(c.get("a").unwrap(), None);
        c.put(entry("a", 1)).unwrap();
        c.put(entry("b", 2)).unwrap();
        assert_eq!(c.get("a").unwrap(), Some(entry("a", 1)));
        assert_eq!(c.get("c").unwrap(), None);
        // The same description replaces its entry.
        let mut a2 = entry("a", 3);
        a2.variants = vec![(960, 576, false, 2)];
        c.put(a2.clone()).unwrap();
        assert_eq!(c.get("a").unwrap(), Some(a2));
        assert_eq!(c.get("b").unwrap(), Some(entry("b", 2)));
        // No temporary file is left beside it.
        assert_eq!(std::fs::read_dir(c.path().parent().unwrap()).unwrap().count(), 1);
        // A corrupt or truncated file: get is an error naming the file, put replaces it.
        std::fs::write(c.path(), b"{\"entries\": {\"x").unwrap();
        let e = c.get("a").unwrap_err().to_string();
        assert!(e.contains(CACHE_FILE), "{e}");
        c.put(entry("b", 4)).unwrap();
        assert_eq!((c.get("a").unwrap(), c.get("b").unwrap()), (None, Some(entry("b", 4))));
        // An entry stored under another description's key (a collision) is not returned.
        let mut f: CacheFileV1 = serde_json::from_slice(&std::fs::read(c.path()).unwrap()).unwrap();
        f.entries.insert(TuneCache::key("z"), entry("not z", 5));
        std::fs::write(c.path(), serde_json::to_vec(&f).unwrap()).unwrap();
        assert_eq!(c.get("z").unwrap(), None);
        // Beyond the cap the oldest entries go.
        for i in 0..CACHE_MAX_ENTRIES as u64 + 5 {
            c.put(entry(&format!("n{i}"), 100 + i)).unwrap();
        }
        assert_eq!(c.read().unwrap().entries.len(), CACHE_MAX_ENTRIES);
        assert_eq!(c.get("n0").unwrap(), None);
        // A step too long to tune is kept as an entry without variants.
        let probe = StepTuneReport {
            first_step_s: 0.00390625,
            best_step_s: 0.00390625,
            shapes: vec![],
            searched: false,
            wall_s: 0.1,
        };
        let long = CacheEntry::from_report("long".into(), &probe, 1000).unwrap();
        assert_eq!(long, CacheEntry { about: "long".into(), variants: vec![], step_us: 3906.25, stored: 1000 });
        c.put(long.clone()).unwrap();
        assert_eq!(c.get("long").unwrap(), Some(long));
        assert!(c.get(&format!("n{}", CACHE_MAX_ENTRIES + 4)).unwrap().is_some());
        // A cache in a place that cannot be written is an error, not a panic.
        let blocked = TuneCache::new(c.path().join("under-a-file.json"));
        assert!(blocked.put(entry("a", 1)).is_err());
    }

    /// A cost model: the step's time is a base plus each shape's cost for its variant plus an
    /// interaction between neighbouring shapes (what timing one GEMV alone cannot see).
    fn step_time(costs: &[Vec<f64>], pair: &[Vec<Vec<f64>>], v: &[usize]) -> f64 {
        let mut t = 1.0;
        for (i, &x) in v.iter().enumerate() {
            t += costs[i][x];
            if i + 1 < v.len() {
                t += pair[i][x][v[i + 1]];
            }
        }
        t
    }

    /// Runs the search against [`step_time`] (its first measurement made here, as the backend
    /// does), checking every `set` is a candidate of its shape. Returns the end setting, the
    /// first and best times, the measurements made and the decisions.
    fn run(
        costs: &[Vec<f64>],
        pair: &[Vec<Vec<f64>>],
        shapes: &[(usize, Vec<usize>)],
        margin: f64,
    ) -> (Vec<usize>, f64, f64, usize, Vec<ShapeChoice>) {
        let v = std::cell::RefCell::new(shapes.iter().map(|s| s.0).collect::<Vec<_>>());
        let mut measured = 0;
        let mut set = |i: usize, c: usize| {
            assert!(shapes[i].1.contains(&c), "shape {i}: {c} is not a candidate");
            v.borrow_mut()[i] = c;
            Ok(())
        };
        let mut measure = || {
            measured += 1;
            Ok(step_time(costs, pair, &v.borrow()))
        };
        let first = measure().unwrap();
        let (best, choices) = coordinate_descent(shapes, margin, first, &mut set, &mut measure).unwrap();
        let end = v.borrow().clone();
        (end, first, best, measured, choices)
    }

    #[test]
    fn a_step_interaction_that_timing_alone_misses_is_found() {
        // Shape 1 alone prefers variant 0 (0.10 vs 0.11), but after shape 0's variant 2 its
        // variant 1 saves 0.05 in the step.
        let costs = vec![vec![0.2, 0.2, 0.2], vec![0.10, 0.11, 0.12]];
        let mut pair = vec![vec![vec![0.0; 3]; 3]; 1];
        pair[0][2][1] = -0.05;
        let shapes = vec![(2, vec![0, 1, 2]), (0, vec![0, 1, 2])];
        let (end, first, best, measured, _) = run(&costs, &pair, &shapes, 0.003);
        assert_eq!(end, vec![2, 1]);
        assert!((first - 1.30).abs() < 1e-12 && (best - 1.26).abs() < 1e-12, "{first} {best}");
        // One measurement to start, then each other candidate once.
        assert_eq!(measured, 1 + 2 + 2);
    }

    #[test]
    fn differences_within_the_margin_keep_the_start_up_choice_and_single_candidates_are_skipped() {
        let costs = vec![vec![0.5, 0.499], vec![0.3]];
        let pair = vec![vec![vec![0.0; 1]; 2]];
        let shapes = vec![(0, vec![0, 1]), (0, vec![0])];
        let (end, first, best, measured, _) = run(&costs, &pair, &shapes, 0.003);
        assert_eq!(end, vec![0, 0]);
        assert_eq!(first, best);
        assert_eq!(measured, 2);
    }

    #[test]
    fn errors_stop_the_search_at_once() {
        let shapes = vec![(0, vec![0, 1, 2]), (0, vec![0, 1])];
        // `set` fails on its first call: nothing is measured after it, nothing else is set.
        let calls = std::cell::RefCell::new(Vec::new());
        let mut set = |i: usize, c: usize| {
            calls.borrow_mut().push(("set", i, c));
            Err(Error::InvalidInput("no".into()))
        };
        let mut measure = || {
            calls.borrow_mut().push(("measure", 0, 0));
            Ok(1.0)
        };
        assert!(coordinate_descent(&shapes, 0.0, 1.0, &mut set, &mut measure).is_err());
        assert_eq!(*calls.borrow(), vec![("set", 0, 1)]);
        // `measure` fails on its second call (shape 0's second candidate): the search stops
        // there, without setting anything back.
        calls.borrow_mut().clear();
        let mut set = |i: usize, c: usize| {
            calls.borrow_mut().push(("set", i, c));
            Ok(())
        };
        let mut n = 0;
        let mut measure = || {
            n += 1;
            calls.borrow_mut().push(("measure", 0, 0));
            if n > 1 {
                Err(Error::InvalidInput("gpu".into()))
            } else {
                Ok(0.5)
            }
        };
        assert!(coordinate_descent(&shapes, 0.0, 1.0, &mut set, &mut measure).is_err());
        assert_eq!(*calls.borrow(), vec![("set", 0, 1), ("measure", 0, 0), ("set", 0, 2), ("measure", 0, 0)]);
        assert!(median(vec![]).is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }

    proptest! {
        /// On any cost model (measurements exact): the search ends at a setting whose time is
        /// the best it reports; every shape timed each of its candidates once and kept one
        /// within the margin of the fastest it timed; and no change of the last shape alone
        /// would gain more than the margin (it was searched with every other shape final).
        #[test]
        fn never_worse_and_ends_where_it_says(
            costs in proptest::collection::vec(proptest::collection::vec(0.0f64..1.0, 4), 1..6),
            seed in 0u64..1000,
        ) {
            let n = costs.len();
            let mut rng = seed;
            let mut next = || { rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (rng >> 33) as f64 / (1u64 << 31) as f64 };
            let pair: Vec<Vec<Vec<f64>>> = (0..n).map(|_| (0..4).map(|_| (0..4).map(|_| next() * 0.2 - 0.1).collect()).collect()).collect();
            let shapes: Vec<(usize, Vec<usize>)> = (0..n).map(|i| (i % 4, vec![0, 1, 2, 3])).collect();
            let (end, _, best, measured, choices) = run(&costs, &pair, &shapes, 0.003);
            prop_assert!((step_time(&costs, &pair, &end) - best).abs() < 1e-12);
            prop_assert_eq!(measured, 1 + 3 * n);
            for c in &choices {
                let mut vs: Vec<usize> = c.timed.iter().map(|t| t.0).collect();
                vs.sort();
                prop_assert_eq!(vs, vec![0, 1, 2, 3]);
                let fastest = c.timed.iter().map(|t| t.1).fold(f64::INFINITY, f64::min);
                let kept = c.timed.iter().find(|t| t.0 == c.to).map(|t| t.1).unwrap();
                prop_assert!(kept * (1.0 - 0.003) <= fastest + 1e-12, "{:?}", c);
                prop_assert_eq!(end[c.shape], c.to);
            }
            // The last shape was searched with every other shape at its final value.
            let last = n - 1;
            for c in 0..4 {
                let mut v = end.clone();
                v[last] = c;
                prop_assert!(step_time(&costs, &pair, &v) >= best * (1.0 - 0.003) - 1e-12);
            }
        }
    }
}
