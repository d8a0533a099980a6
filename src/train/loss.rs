//! The training loss: a weighted cross-entropy on the readout after every pass (SPEED §4's
//! per-layer-group loss; Ouro's per-step loss), with passes before R also distilled towards
//! pass R's distribution (`train.agreement_weight`) and pass R towards pass 1's
//! (`train.last_pass_agreement_weight`).

use candle_core::Tensor;

use super::fused::{self, Fused};
use crate::engine::error::Result;

/// Cross-entropy of `logits` against (1 − alpha)·one-hot(`targets`) + alpha·`soft`: the
/// differentiable mixed loss and the plain cross-entropy's value.
pub(super) fn mixed_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    soft: &Tensor,
    alpha: f64,
) -> Result<(Tensor, f64)> {
    if Fused::runs_on(logits) {
        let both = fused::cross_entropy(logits, &targets.to_vec1::<u32>()?, soft, alpha)?;
        let hard = both.get(1)?.to_scalar::<f32>()? as f64;
        return Ok((both.get(0)?, hard));
    }
    let hard = candle_nn::loss::cross_entropy(logits, targets)?;
    let value = hard.to_scalar::<f32>()? as f64;
    if alpha == 0.0 {
        return Ok((hard, value));
    }
    let log_p = candle_nn::ops::log_softmax(logits, 1)?;
    let soft_ce = (soft * log_p)?.sum(1)?.mean(0)?.neg()?;
    Ok((((hard * (1.0 - alpha))? + (soft_ce * alpha)?)?, value))
}

/// The distilled target of a pass: the teacher's detached distribution at `temperature`, or
/// (when `alpha` is 0 and the target is never read) the detached logits themselves.
pub(super) fn soft_target(teacher: &Tensor, alpha: f64, temperature: f64) -> Result<Tensor> {
    let logits = teacher.detach();
    if alpha == 0.0 {
        return Ok(logits);
    }
    let scaled = if temperature == 1.0 {
        logits
    } else {
        (logits / temperature)?
    };
    Ok(candle_nn::ops::softmax_last_dim(&scaled)?)
}
