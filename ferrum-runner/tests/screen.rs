//! The screened LM head (`ferrum_runner::screen`) on the random weights that `ferrum bench
//! --synthetic smollm2-135m` decodes: the screened greedy token is the full head's at every
//! step, and the test prints how many of the 49152 rows each width leaves. (The real model's
//! figures come from `fixture.rs`'s `screened_head_keeps_the_greedy_tokens`.) And the head's
//! input as `CpuModel::forward_normed` gives it, with its bad-input refusals.
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

/// `CpuModel::forward_normed` returns the LM head's input (its product with the head is the
/// logits `forward_with` returns for the same tokens), and refuses bad input like
/// `forward_with` does, leaving the cache as it was.
#[test]
fn forward_normed_is_the_heads_input_and_refuses_bad_input() {
    use ferrum_runner::config::Arch;
    use ferrum_runner::error::Error;
    use ferrum_runner::synthetic::random_config;
    for tied in [true, false] {
        let cfg = random_config(Arch::Llama, tied);
        let weights = random_weights(&cfg, DType::F32, 3).unwrap();
        let model = CpuModel::new(&weights).unwrap();
        let w = weights.lm_head.to_dense(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let cols = cfg.hidden_size;
        let tokens = common::prompt(5, cfg.vocab_size, 9);

        let mut cache = model.new_cache(6).unwrap();
        let x = model.forward_normed(&mut cache, &tokens).unwrap();
        assert_eq!((x.len(), cache.len()), (cols, 5));
        let mut other = model.new_cache(6).unwrap();
        let logits = model.prefill(&mut other, &tokens).unwrap();
        let from_x: Vec<f32> = w.chunks_exact(cols).map(|row| row.iter().zip(&x).map(|(a, b)| a * b).sum()).collect();
        assert!(common::rel_err(&from_x, &logits) < 1e-5, "tied {tied}: {}", common::rel_err(&from_x, &logits));

        assert!(matches!(model.forward_normed(&mut cache, &[]), Err(Error::InvalidInput(_))));
        let bad = [cfg.vocab_size as u32];
        assert!(matches!(model.forward_normed(&mut cache, &bad), Err(Error::TokenOutOfRange { .. })));
        assert!(matches!(model.forward_normed(&mut cache, &tokens[..2]), Err(Error::ContextOverflow { .. })));
        assert_eq!(cache.len(), 5, "a refused call leaves the cache as it was");
        assert_eq!(model.forward_normed(&mut cache, &tokens[..1]).unwrap().len(), cols);
        assert_eq!(cache.len(), 6);
    }
}
