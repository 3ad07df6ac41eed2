//! The screened LM head (`ferrum_runner::screen`) on the random weights that `ferrum bench
//! --synthetic smollm2-135m` decodes: the screened greedy token is the full head's at every
//! step, and the test prints how many of the 49152 rows each width leaves. (The real model's
//! figures come from `fixture.rs`'s `screened_head_keeps_the_greedy_tokens`.)
mod common;

use candle_core::DType;
use ferrum_runner::model::CpuModel;
use ferrum_runner::screen::ScreenedHead;
use ferrum_runner::synthetic::{named_config, random_weights};

#[test]
fn screened_head_keeps_the_greedy_tokens_of_random_smollm2_weights() {
    let cfg = named_config("smollm2-135m").unwrap();
    let weights = random_weights(&cfg, DType::F32, 11).unwrap();
    let model = CpuModel::new(&weights).unwrap();
    let w = weights.lm_head.to_dense(DType::F32).unwrap();
    let (rows, cols) = w.dims2().unwrap();
    let w = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let heads = [8, 4].map(|bits| ScreenedHead::new(&w, rows, cols, bits).unwrap());
    let counts = common::screened_greedy(&model, &w, cols, &heads, &common::prompt(8, rows, 5), 12);
    common::report_screening("random smollm2-135m weights", &heads, &counts);
}
