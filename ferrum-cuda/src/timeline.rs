//! Kernel timelines of replayed decode steps, from the timeline build of the kernels
//! (`cargo xtask ptx --timeline`, a measurement build: common.cuh's `FERRUM_TIMELINE`).
//!
//! In that build the first thread of every block stamps `%globaltimer` right after its
//! programmatic-launch wait, while the host has armed a replay number, into its grid's slot of
//! that replay's row of a per-module table (`%gridid` modulo [`NODES`]: in a graph replay the
//! grid ids' low bits number the kernel nodes): the grid id, the earliest and the latest stamp,
//! and the number of blocks. A kernel's
//! earliest stamp is when the kernel before it had completed and its writes were visible, so
//! the difference between two consecutive kernels' earliest stamps is what the first kernel
//! cost the step inside the graph, overlap with its neighbours included — the figure that an
//! event after every kernel (`--kernel-profile`) distorts.
//!
//! This module holds the pure part (the table layout and the analysis); the runner arms the
//! tables and reads them (`CudaDecodeRunner::timeline_arm`, `timeline_read`), and the graph
//! layer names the kernels (`ferrum_graph::CapturedGraph::kernel_names`).

/// Replay rows per module table (common.cuh's `FERRUM_TL_REPLAYS`): at most this many replays
/// are recorded between two reads.
pub const REPLAYS: usize = 64;
/// Slots per replay row (common.cuh's `FERRUM_TL_NODES`): grid ids are taken modulo this.
pub const NODES: usize = 4096;
/// Phases of a kernel body that the timeline build can stamp (common.cuh's
/// `FERRUM_TL_PHASES`; the GEMVs stamp 4, the fused decode attention 6: gemv.cu and
/// attention.cu list them).
pub const PHASES: usize = 6;
/// One position of the repeating layer: its kernel's name, its mean cost (ns) and the mean time
/// of each phase its body stamps (ns after its earliest release; [`layer_phases`]).
pub type LayerKernel = (String, f64, [Option<f64>; PHASES]);

/// Bytes per slot: `grid: u64, first: u64, last_not: u64, blocks: u32, pad: u32,
/// arrive_first: u64, arrive_last_not: u64, phase_last_not: [u64; PHASES]`.
pub const SLOT_BYTES: usize = 48 + 8 * PHASES;

/// One grid's stamps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GridStamp {
    /// `%gridid` (unique per launch in a context, increasing in launch order).
    pub grid: u64,
    /// Earliest wait release of its blocks (ns, `%globaltimer`).
    pub first_ns: u64,
    /// Latest wait release of its blocks (ns): a block resident only after others finished.
    pub last_ns: u64,
    /// Blocks that stamped (the first 8 and every 32nd: common.cuh).
    pub blocks: u32,
    /// Earliest arrival of its stamped blocks at the wait (ns): the timer read just before it,
    /// after the kernel's pre-wait work (the early weight and cache loads are issued, not done).
    pub arrive_first_ns: u64,
    /// Latest arrival at the wait (ns): later than `first_ns` when a block was dispatched after
    /// the kernel before had completed, or its pre-wait path outlasted that kernel.
    pub arrive_last_ns: u64,
    /// The latest time a stamped block's first thread reached phase k of the kernel's body
    /// (ns; 0: the kernel has no such phase, or no stamped block reached it).
    pub phase_last_ns: [u64; PHASES],
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// The stamped slots of one module table (reset to all-ones bytes, then stamped), per replay
/// row: `REPLAYS` rows of `NODES` slots; a slot whose block count is still all-ones was not
/// stamped. Each row comes sorted by grid id.
pub fn parse_table(bytes: &[u8]) -> Vec<Vec<GridStamp>> {
    let mut rows: Vec<Vec<GridStamp>> = bytes
        .chunks(NODES * SLOT_BYTES)
        .map(|row| {
            row.chunks_exact(SLOT_BYTES)
                .filter_map(|s| {
                    let mut c = [0u8; 4];
                    c.copy_from_slice(&s[24..28]);
                    // The count starts at all-ones and each block adds one.
                    let blocks = u32::from_le_bytes(c).wrapping_add(1);
                    (blocks != 0).then(|| GridStamp {
                        grid: u64_at(s, 0),
                        first_ns: u64_at(s, 8),
                        last_ns: !u64_at(s, 16),
                        blocks,
                        arrive_first_ns: u64_at(s, 32),
                        arrive_last_ns: !u64_at(s, 40),
                        // Reset to all-ones: complemented, an unstamped phase reads 0.
                        phase_last_ns: std::array::from_fn(|k| !u64_at(s, 48 + 8 * k)),
                    })
                })
                .collect()
        })
        .collect();
    for r in &mut rows {
        r.sort_by_key(|s| s.grid);
    }
    rows
}

/// One kernel of the step (one graph kernel node), over the recorded replays.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelTime {
    /// Its function name.
    pub name: String,
    /// Sum over the recorded replays of the time from its earliest wait release to the next
    /// kernel's (ns): what it cost the step.
    pub sum_ns: f64,
    /// How many such durations `sum_ns` holds (replays in which it and its successor stamped).
    pub durations: usize,
    /// Sum of the time from its earliest to its latest wait release (ns).
    pub spread_sum_ns: f64,
    /// Sum of its earliest arrival at the wait minus its earliest release (ns; negative: blocks
    /// were waiting before the kernel ahead completed).
    pub arrive_first_sum_ns: f64,
    /// Sum of its latest arrival at the wait minus its earliest release (ns; positive: a block
    /// arrived after the release, late dispatch or a long pre-wait path).
    pub arrive_last_sum_ns: f64,
    /// Sum over the replays that stamped phase k of its latest time minus the earliest release
    /// (ns), and how many replays did.
    pub phase_sum_ns: [f64; PHASES],
    /// See `phase_sum_ns`.
    pub phase_samples: [usize; PHASES],
    /// Blocks that stamped, in the last replay that stamped it (see [`GridStamp::blocks`]).
    pub blocks: u32,
    /// Replays in which it stamped.
    pub samples: usize,
}

impl KernelTime {
    /// Mean cost to the step (ns); `None` without a duration.
    pub fn mean_ns(&self) -> Option<f64> {
        (self.durations > 0).then(|| self.sum_ns / self.durations as f64)
    }
    /// Mean spread of its blocks' wait releases (ns).
    pub fn spread_ns(&self) -> f64 {
        self.per_sample(self.spread_sum_ns)
    }
    /// Mean of its earliest and of its latest arrival at the wait, relative to its earliest
    /// release (ns).
    pub fn arrivals_ns(&self) -> (f64, f64) {
        (self.per_sample(self.arrive_first_sum_ns), self.per_sample(self.arrive_last_sum_ns))
    }
    /// Mean time from its earliest release to the latest stamped block's phase k (ns), for the
    /// phases its body stamps.
    pub fn phases_ns(&self) -> [Option<f64>; PHASES] {
        std::array::from_fn(|k| {
            (self.phase_samples[k] > 0).then(|| self.phase_sum_ns[k] / self.phase_samples[k] as f64)
        })
    }
    fn per_sample(&self, sum: f64) -> f64 {
        if self.samples > 0 {
            sum / self.samples as f64
        } else {
            0.0
        }
    }
}

/// The recorded replays of one graph, kernel by kernel.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimeline {
    /// Every kernel node, in graph order.
    pub kernels: Vec<KernelTime>,
    /// Replays mapped (every kernel node stamped once).
    pub replays: usize,
    /// Sum over the mapped replays of the time from the first kernel's release to the last
    /// one's (ns).
    pub span_sum_ns: f64,
    /// Replay rows with stamps that could not be mapped (not one stamp per kernel node): a
    /// kernel without the stamp, or two nodes in one slot. Nonzero: those replays are left out.
    pub unmapped: usize,
    /// The first unmapped row's `(stamps, kernel nodes)`, to say why nothing mapped (more
    /// stamps than nodes: a kernel the names leave out stamps; fewer: a named kernel does not
    /// stamp, see [`stamps`], or two nodes share a slot).
    pub first_unmapped: Option<(usize, usize)>,
    /// Consecutive kernels whose releases run backwards in a mapped replay (nonzero: the grid
    /// order is not the node order, and the figures are not trustworthy).
    pub out_of_order: usize,
    /// The grid ids of the first mapped replay's first nodes (for the record).
    pub first_grids: Vec<u64>,
}

/// Why [`StepTimeline::merge`] refused a recording: it is of another graph.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MergeError {
    /// The graphs have different numbers of kernel nodes.
    #[error("timelines of different graphs: {ours} kernel nodes, and {theirs} in the one merged")]
    NodeCount {
        /// The merged-into timeline's kernel nodes.
        ours: usize,
        /// The merged timeline's kernel nodes.
        theirs: usize,
    },
    /// Kernel node `node` (the first that differs) runs different kernels.
    #[error("timelines of different graphs: kernel node {node} is {ours}, and {theirs} in the one merged")]
    Kernel {
        /// The node's index.
        node: usize,
        /// Its kernel in the merged-into timeline.
        ours: String,
        /// Its kernel in the merged timeline.
        theirs: String,
    },
}

impl StepTimeline {
    /// Mean time from a replay's first kernel release to its last one's (ns).
    pub fn span_ns(&self) -> Option<f64> {
        (self.replays > 0).then(|| self.span_sum_ns / self.replays as f64)
    }

    /// Adds another recording of the same graph (e.g. the next batch of replays); an empty
    /// timeline takes `o` as it is.
    ///
    /// # Errors
    /// [`MergeError`] when the graphs differ (another number of kernel nodes, or another kernel
    /// at some node); `self` is left unchanged.
    pub fn merge(&mut self, o: &StepTimeline) -> Result<(), MergeError> {
        if self.kernels.is_empty() && self.replays == 0 {
            *self = o.clone();
            return Ok(());
        }
        if self.kernels.len() != o.kernels.len() {
            return Err(MergeError::NodeCount { ours: self.kernels.len(), theirs: o.kernels.len() });
        }
        if let Some((node, (a, b))) =
            self.kernels.iter().zip(&o.kernels).enumerate().find(|(_, (a, b))| a.name != b.name)
        {
            return Err(MergeError::Kernel { node, ours: a.name.clone(), theirs: b.name.clone() });
        }
        for (a, b) in self.kernels.iter_mut().zip(&o.kernels) {
            a.sum_ns += b.sum_ns;
            a.durations += b.durations;
            a.spread_sum_ns += b.spread_sum_ns;
            a.arrive_first_sum_ns += b.arrive_first_sum_ns;
            a.arrive_last_sum_ns += b.arrive_last_sum_ns;
            for k in 0..PHASES {
                a.phase_sum_ns[k] += b.phase_sum_ns[k];
                a.phase_samples[k] += b.phase_samples[k];
            }
            a.samples += b.samples;
            if b.samples > 0 {
                a.blocks = b.blocks;
            }
        }
        self.replays += o.replays;
        self.span_sum_ns += o.span_sum_ns;
        self.unmapped += o.unmapped;
        self.first_unmapped = self.first_unmapped.or(o.first_unmapped);
        self.out_of_order += o.out_of_order;
        if self.first_grids.is_empty() {
            self.first_grids = o.first_grids.clone();
        }
        Ok(())
    }
}

/// Whether a graph's kernel node named `name` stamps in the timeline build, so that
/// [`step_timeline`] maps it: ferrum's kernels (`ferrum_*`) launched from the CUDA runner's
/// modules, whose tables the runner reads. Not the nodes of other libraries (NCCL, cuBLAS), and
/// not the peer group's one-shot all-reduce (`ferrum_peer_all_reduce_*`: the TP vocab split's
/// exchange of each rank's best logit), which `peer` launches from a module of its own, loaded
/// from the compute_80 PTX without the programmatic-launch wait the stamp sits in (and whose
/// table nobody reads). The peer add + RMSNorm kernels come from the runner's modules and stamp.
pub fn stamps(name: &str) -> bool {
    name.starts_with("ferrum_") && !PEER_GROUP_KERNELS.iter().any(|k| k.name() == name)
}

/// The kernels that the peer group launches from its own module of the compute_80 PTX (its
/// one-shot all-reduce per element type, in `PeerElement::INDEX` order; `peer` checks the two
/// agree at compile time). They never stamp.
pub const PEER_GROUP_KERNELS: [crate::Kernel; 3] =
    [crate::Kernel::PeerAllReduceF32, crate::Kernel::PeerAllReduceF16, crate::Kernel::PeerAllReduceBf16];

/// Maps each replay row's stamps (sorted by grid id: launch order) onto the graph's kernel
/// nodes `names` by position, when the row has exactly one stamp per node; other nonempty rows
/// count as `unmapped`. A kernel's duration is the next node's earliest release minus its own
/// (the last node has none).
pub fn step_timeline(rows: &[Vec<GridStamp>], names: &[String]) -> StepTimeline {
    let k = names.len();
    let mut t = StepTimeline {
        kernels: names.iter().map(|name| KernelTime { name: name.clone(), ..Default::default() }).collect(),
        ..Default::default()
    };
    for row in rows.iter().filter(|r| !r.is_empty()) {
        if row.len() != k {
            t.unmapped += 1;
            t.first_unmapped = t.first_unmapped.or(Some((row.len(), k)));
            continue;
        }
        if t.first_grids.is_empty() {
            t.first_grids = row.iter().take(4).map(|s| s.grid).collect();
        }
        t.replays += 1;
        t.span_sum_ns += row[k - 1].first_ns.saturating_sub(row[0].first_ns) as f64;
        for (i, s) in row.iter().enumerate() {
            let kt = &mut t.kernels[i];
            kt.spread_sum_ns += s.last_ns.saturating_sub(s.first_ns) as f64;
            // Differences in integers first: `%globaltimer` counts ns since 1970 (~1.8e18),
            // where an f64 resolves only 256 ns.
            kt.arrive_first_sum_ns += s.arrive_first_ns.wrapping_sub(s.first_ns) as i64 as f64;
            kt.arrive_last_sum_ns += s.arrive_last_ns.wrapping_sub(s.first_ns) as i64 as f64;
            for (k, &p) in s.phase_last_ns.iter().enumerate() {
                if p != 0 {
                    kt.phase_sum_ns[k] += p.wrapping_sub(s.first_ns) as i64 as f64;
                    kt.phase_samples[k] += 1;
                }
            }
            kt.blocks = s.blocks;
            kt.samples += 1;
            if let Some(n) = row.get(i + 1) {
                if n.first_ns < s.first_ns {
                    t.out_of_order += 1;
                } else {
                    kt.sum_ns += (n.first_ns - s.first_ns) as f64;
                    kt.durations += 1;
                }
            }
        }
    }
    t
}

/// The repeating layer of a step: `(start, period)` such that nodes `start + j + l * period`
/// have the same name for every layer `l` and `j < period`, found from the nodes named like
/// the decode attention (`"attn"` in the name, not `"combine"`); `None` with fewer than three
/// such nodes or irregular spacing.
pub fn layer_period(names: &[String]) -> Option<(usize, usize)> {
    let at: Vec<usize> = names
        .iter()
        .enumerate()
        .filter(|(_, n)| n.contains("attn") && !n.contains("combine"))
        .map(|(i, _)| i)
        .collect();
    if at.len() < 3 {
        return None;
    }
    let p = at[2] - at[1];
    (p > 0 && at.windows(2).skip(1).all(|w| w[1] - w[0] == p)).then_some((at[1], p))
}

/// The mean cost of each position of the repeating layer over the middle layers (every layer
/// but the first and the last, whose neighbours differ), as `(name, mean ns)` from the
/// attention on; `None` when [`layer_period`] finds no layer or no replay was mapped.
pub fn layer_profile(t: &StepTimeline) -> Option<Vec<(String, f64)>> {
    Some(layer_phases(t)?.into_iter().map(|(n, m, _)| (n, m)).collect())
}

/// [`layer_profile`] with each position's mean phase times too (ns after its earliest release,
/// over the middle layers that stamped the phase: [`KernelTime::phases_ns`]).
pub fn layer_phases(t: &StepTimeline) -> Option<Vec<LayerKernel>> {
    if t.replays == 0 {
        return None;
    }
    let names: Vec<String> = t.kernels.iter().map(|k| k.name.clone()).collect();
    let (start, p) = layer_period(&names)?;
    let layers = names.iter().enumerate().filter(|(_, n)| n.contains("attn") && !n.contains("combine")).count();
    let mut out = Vec::with_capacity(p);
    for j in 0..p {
        let (mut sum, mut n) = (0.0, 0usize);
        let (mut ph, mut phn) = ([0.0f64; PHASES], [0usize; PHASES]);
        // Layers 1 .. layers - 1 (their attention at start + (l - 1) p).
        for l in 0..layers.saturating_sub(2) {
            let Some(kt) = t.kernels.get(start + j + l * p) else { continue };
            if let Some(m) = kt.mean_ns() {
                sum += m;
                n += 1;
            }
            for (k, v) in kt.phases_ns().iter().enumerate() {
                if let Some(v) = v {
                    ph[k] += v;
                    phn[k] += 1;
                }
            }
        }
        let phases = std::array::from_fn(|k| (phn[k] > 0).then(|| ph[k] / phn[k] as f64));
        out.push((names[start + j].clone(), if n > 0 { sum / n as f64 } else { f64::NAN }, phases));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kernel;

    #[test]
    fn only_the_runner_modules_kernels_stamp() {
        // Every listed kernel but the peer group's own stamps (the peer add + RMSNorm and the
        // `_push` GEMVs come from the runner's modules); other libraries' kernels never do.
        let own = Kernel::ALL.iter().filter(|k| !stamps(k.name())).copied().collect::<Vec<_>>();
        assert_eq!(own, PEER_GROUP_KERNELS);
        assert!(stamps("ferrum_peer_add_rmsnorm_pushed_bf16") && stamps("ferrum_gemv4_push_bf16"));
        for n in ["ncclDevKernel_AllReduce_Sum_f32", "sm90_xmma_gemm_bf16bf16"] {
            assert!(!stamps(n), "{n}");
        }
    }

    fn slot(grid: u64, first: u64, last: u64, blocks: u32, arrive: (u64, u64)) -> [u8; SLOT_BYTES] {
        let mut s = [0xffu8; SLOT_BYTES];
        s[0..8].copy_from_slice(&grid.to_le_bytes());
        s[8..16].copy_from_slice(&first.to_le_bytes());
        s[16..24].copy_from_slice(&(!last).to_le_bytes());
        s[24..28].copy_from_slice(&blocks.wrapping_sub(1).to_le_bytes());
        s[32..40].copy_from_slice(&arrive.0.to_le_bytes());
        s[40..48].copy_from_slice(&(!arrive.1).to_le_bytes());
        s
    }

    fn slot_phases(base: [u8; SLOT_BYTES], phases: &[(usize, u64)]) -> [u8; SLOT_BYTES] {
        let mut s = base;
        for &(k, t) in phases {
            s[48 + 8 * k..56 + 8 * k].copy_from_slice(&(!t).to_le_bytes());
        }
        s
    }

    #[test]
    fn a_reset_table_has_no_stamps_and_stamped_slots_parse_per_replay_row() {
        let mut t = vec![0xffu8; 2 * NODES * SLOT_BYTES];
        assert!(parse_table(&t).iter().all(Vec::is_empty));
        let at = |row: usize, slot: usize| (row * NODES + slot) * SLOT_BYTES;
        t[at(1, 9)..at(1, 10)].copy_from_slice(&slot(9, 300, 300, 1, (290, 290)));
        t[at(1, 5)..at(1, 6)].copy_from_slice(&slot_phases(slot(4101, 100, 250, 3, (40, 240)), &[(0, 400), (5, 900)]));
        let rows = parse_table(&t);
        assert_eq!(rows.len(), 2);
        assert!(rows[0].is_empty());
        assert_eq!(
            rows[1],
            vec![
                GridStamp {
                    grid: 9,
                    first_ns: 300,
                    last_ns: 300,
                    blocks: 1,
                    arrive_first_ns: 290,
                    arrive_last_ns: 290,
                    phase_last_ns: [0; PHASES]
                },
                GridStamp {
                    grid: 4101,
                    first_ns: 100,
                    last_ns: 250,
                    blocks: 3,
                    arrive_first_ns: 40,
                    arrive_last_ns: 240,
                    phase_last_ns: [400, 0, 0, 0, 0, 900]
                },
            ]
        );
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    fn g(grid: u64, first_ns: u64, last_ns: u64, blocks: u32) -> GridStamp {
        // Arrivals 50 ns before the first release (or at 0) and at the last one.
        GridStamp {
            grid,
            first_ns,
            last_ns,
            blocks,
            arrive_first_ns: first_ns.saturating_sub(50),
            arrive_last_ns: last_ns,
            phase_last_ns: [0; PHASES],
        }
    }

    #[test]
    fn rows_map_onto_nodes_by_position_and_durations_are_next_minus_this() {
        let nm = names(&["embed", "qkv", "attn"]);
        let rows = vec![
            vec![g(65536, 1000, 1000, 1), g(65537, 1100, 1150, 8), g(65538, 1400, 1400, 4)],
            vec![],
            vec![g(131072, 2000, 2000, 1), g(131073, 2120, 2120, 8), g(131074, 2420, 2420, 2)],
            // A row missing a node is left out.
            vec![g(196608, 3000, 3000, 1), g(196609, 3100, 3100, 8)],
        ];
        let t = step_timeline(&rows, &nm);
        assert_eq!((t.replays, t.unmapped, t.out_of_order), (2, 1, 0));
        assert_eq!(t.first_unmapped, Some((2, 3)));
        assert_eq!(t.span_ns(), Some(410.0));
        assert_eq!(t.kernels[0].mean_ns(), Some(110.0)); // (100 + 120) / 2
        assert_eq!(t.kernels[1].mean_ns(), Some(300.0));
        assert_eq!(t.kernels[1].spread_ns(), 25.0);
        assert_eq!(t.kernels[1].arrivals_ns(), (-50.0, 25.0));
        assert_eq!(t.kernels[2].mean_ns(), None); // the last node has no successor
        assert_eq!((t.kernels[2].samples, t.kernels[2].blocks), (2, 2));
        assert_eq!(t.first_grids, vec![65536, 65537, 65538]);
        // A second recording of the same graph merges by sums; another graph is refused.
        let mut m = StepTimeline::default();
        m.merge(&t).unwrap();
        m.merge(&t).unwrap();
        assert_eq!(
            (m.replays, m.span_ns(), m.kernels[1].mean_ns(), m.kernels[1].samples),
            (4, Some(410.0), Some(300.0), 4)
        );
        assert_eq!(m.kernels[1].arrivals_ns(), t.kernels[1].arrivals_ns());
        assert!(m.merge(&step_timeline(&rows, &names(&["x", "qkv", "attn"]))).is_err());
    }

    #[test]
    fn merging_another_graph_is_a_typed_error() {
        let nm = names(&["norm", "qkv", "attn"]);
        let t = step_timeline(&[vec![g(65536, 1000, 1000, 1), g(65537, 1100, 1100, 1), g(65538, 1300, 1300, 1)]], &nm);
        let mut m = StepTimeline::default();
        m.merge(&t).unwrap();
        let other = step_timeline(
            &[vec![g(65536, 1000, 1000, 1), g(65537, 1100, 1100, 1), g(65538, 1300, 1300, 1)]],
            &names(&["norm", "x", "attn"]),
        );
        assert_eq!(m.merge(&other), Err(MergeError::Kernel { node: 1, ours: "qkv".into(), theirs: "x".into() }));
        let shorter =
            step_timeline(&[vec![g(65536, 1000, 1000, 1), g(65537, 1100, 1100, 1)]], &names(&["norm", "qkv"]));
        assert_eq!(m.merge(&shorter), Err(MergeError::NodeCount { ours: 3, theirs: 2 }));
        // A refused merge leaves the timeline as it was; the text form says the same.
        assert_eq!(m.replays, 1);
        let text = m.merge(&shorter).unwrap_err().to_string();
        assert_eq!(text, MergeError::NodeCount { ours: 3, theirs: 2 }.to_string());
        assert!(text.starts_with("timelines of different graphs"), "{text}");
    }

    #[test]
    fn arrivals_keep_nanoseconds_at_real_timer_values() {
        // %globaltimer near 2026 (~1.8e18 ns): the arrival 70 ns before and 30 ns after the
        // first release, which converting each stamp to f64 first would round to 0 or 256.
        let t0 = 1_764_590_000_123_456_789u64;
        let st = GridStamp {
            grid: 1,
            first_ns: t0,
            last_ns: t0 + 40,
            blocks: 2,
            arrive_first_ns: t0 - 70,
            arrive_last_ns: t0 + 30,
            phase_last_ns: [t0 + 310, 0, t0 + 1200, 0, 0, 0],
        };
        let t = step_timeline(&[vec![st]], &names(&["k"]));
        assert_eq!(t.kernels[0].arrivals_ns(), (-70.0, 30.0));
        assert_eq!(t.kernels[0].spread_ns(), 40.0);
        assert_eq!(t.kernels[0].phases_ns(), [Some(310.0), None, Some(1200.0), None, None, None]);
        // Phases merge by sums and counts like the rest: a second recording with phase 0 at
        // +510 and phase 1 stamped gives phase 0 the mean of both and phase 1 its one value.
        let st2 = GridStamp { phase_last_ns: [t0 + 510, t0 + 90, 0, 0, 0, 0], ..st };
        let mut m = t.clone();
        m.merge(&step_timeline(&[vec![st2]], &names(&["k"]))).unwrap();
        assert_eq!(m.kernels[0].phases_ns(), [Some(410.0), Some(90.0), Some(1200.0), None, None, None]);
        assert_eq!(m.kernels[0].phase_samples, [2, 1, 1, 0, 0, 0]);
    }

    #[test]
    fn a_wrong_mapping_shows_as_out_of_order() {
        let nm = names(&["a", "b"]);
        let t = step_timeline(&[vec![g(1, 500, 500, 1), g(2, 100, 100, 1)]], &nm);
        assert_eq!(t.out_of_order, 1);
        assert_eq!(step_timeline(&[], &nm).replays, 0);
    }

    #[test]
    fn the_layer_period_comes_from_the_attention_nodes() {
        let mut nm = names(&["embed"]);
        for _ in 0..4 {
            nm.extend(names(&["qkv", "attn_x", "o", "gu", "down"]));
        }
        nm.extend(names(&["head", "argmax"]));
        assert_eq!(layer_period(&nm), Some((7, 5)));
        assert_eq!(layer_period(&names(&["attn", "x", "attn"])), None);
        let st: Vec<GridStamp> = (0..nm.len() as u64).map(|i| g(100 + i, 10 * i * i, 10 * i * i, 1)).collect();
        let t = step_timeline(std::slice::from_ref(&st), &nm);
        let lp = layer_profile(&t).unwrap();
        assert_eq!(lp.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["attn_x", "o", "gu", "down", "qkv"]);
        // Node i costs 10 ((i+1)^2 - i^2) = 10 (2i + 1); layers 1 and 2 (attention at 7, 12).
        assert_eq!(lp[0].1, (10.0 * 15.0 + 10.0 * 25.0) / 2.0);
        // Phases: the attention of layer 1 (node 7) stamped phase 1 at +100 ns, layer 2's (node
        // 12) at +300; layer 0's (node 2, not a middle layer) is left out.
        let mut st2 = st.clone();
        for (i, d) in [(2usize, 900u64), (7, 100), (12, 300)] {
            st2[i].phase_last_ns[1] = st2[i].first_ns + d;
        }
        let lph = layer_phases(&step_timeline(std::slice::from_ref(&st2), &nm)).unwrap();
        assert_eq!((lph[0].1, lph[0].2[1], lph[0].2[0], lph[1].2[1]), (lp[0].1, Some(200.0), None, None));
        // A kernel that does not stamp (session 24: the TP vocab split's peer all-reduce): no
        // replay maps, the first row says how many stamps it had, and there is no layer.
        let t = step_timeline(&[st[..st.len() - 1].to_vec()], &nm);
        assert_eq!((t.replays, t.unmapped, t.first_unmapped), (0, 1, Some((nm.len() - 1, nm.len()))));
        assert_eq!(layer_profile(&t), None);
    }
}
