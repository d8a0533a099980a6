//! Where the host path's weights live in memory: one arena of huge pages that the weight
//! matrices are copied into (`into_arena`, for `model::Weights::aligned_for_host`), and
//! handing freed heap memory back to the kernel while loading; and whether a GPU has room for
//! a checkpoint's weights before they are loaded (`check_device_room`, for the loaders). Best effort everywhere: a system without either loses nothing else.

use candle_core::{DType, Tensor};

/// Offers `buf`'s whole 2 MB pages to the kernel as transparent huge pages: before the memory
/// is first written (`collapse` false: later faults get huge pages) or after it (`collapse`
/// true: the kernel merges what is already there, Linux ≥ 6.1). Best effort: systems without
/// THP, or with it off, keep 4 KB pages and lose nothing else.
pub fn advise_huge_pages<T>(buf: &[T], collapse: bool) {
    #[cfg(target_os = "linux")]
    {
        /// `MADV_COLLAPSE` (Linux 6.1), not in every libc crate release.
        const MADV_COLLAPSE: libc::c_int = 25;
        const HUGE: usize = 2 << 20;
        let start = buf.as_ptr() as usize;
        let first = start.next_multiple_of(HUGE);
        let end = (start + std::mem::size_of_val(buf)) / HUGE * HUGE;
        if end <= first {
            return;
        }
        let advice = if collapse {
            MADV_COLLAPSE
        } else {
            libc::MADV_HUGEPAGE
        };
        // SAFETY: [first, end) lies inside `buf`'s allocation and is page aligned; both advices
        // only change how the kernel backs the pages, never their contents. Errors are ignored.
        unsafe { libc::madvise(first as *mut libc::c_void, end - first, advice) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (buf, collapse);
}

/// Checks that `device` has room for the weights of a checkpoint of `config` in `dtype` before
/// they are loaded, so that a model too large for a GPU is one line naming both sizes instead
/// of a failed allocation halfway through the load. The CPU and Metal: nothing to check.
pub fn check_device_room(
    device: &candle_core::Device,
    config: &super::OuroConfig,
    dtype: DType,
    what: &std::path::Path,
) -> super::error::Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        let elements: usize = (super::format::checkpoint_tensors(config).iter())
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        let bytes = elements * dtype.size_in_bytes();
        let gb = |b: usize| b as f64 / 1e9;
        let (free, total) = (cuda.cuda_stream().context().mem_get_info())
            .map_err(|e| super::EngineError::file(what, format!("cuda: {e}")))?;
        if bytes > free {
            return Err(super::EngineError::file(
                what,
                format!(
                    "the weights need {:.2} GB and the GPU has {:.2} GB free (of {:.2} GB)",
                    gb(bytes),
                    gb(free),
                    gb(total)
                ),
            ));
        }
    }
    let _ = (device, config, dtype, what);
    Ok(())
}

/// Hands memory the allocator holds free back to the kernel. glibc raises its mmap threshold
/// after the first large free, so weights freed one by one while loading stay resident in the
/// heap unless trimmed. A no-op elsewhere.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own heap to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Copies CPU matrices into one arena of their element type (the first matrix's; the others
/// are converted to it, which a checkpoint loaded in one dtype never needs): it starts on a
/// 2 MB boundary and is offered to the kernel as huge pages, and every matrix starts on a
/// 64-byte boundary. Each tensor becomes a view into the arena.
pub fn into_arena(mats: &mut [&mut Tensor]) -> candle_core::Result<()> {
    match mats.first().map(|t| t.dtype()) {
        None => Ok(()),
        Some(DType::BF16) => into_arena_of::<half::bf16>(mats),
        Some(DType::F16) => into_arena_of::<half::f16>(mats),
        Some(_) => into_arena_of::<f32>(mats),
    }
}

/// [`into_arena`] with elements `T`.
fn into_arena_of<T: candle_core::WithDType>(mats: &mut [&mut Tensor]) -> candle_core::Result<()> {
    const HUGE_BYTES: usize = 2 << 20;
    let (huge, line) = (HUGE_BYTES / T::DTYPE.size_in_bytes(), 64 / T::DTYPE.size_in_bytes());
    let Some(device) = mats.first().map(|t| t.device().clone()) else {
        return Ok(());
    };
    let slots: Vec<usize> = mats
        .iter()
        .map(|t| t.elem_count().div_ceil(line) * line)
        .collect();
    let total: usize = slots.iter().sum();
    let mut arena = vec![T::zero(); total + huge];
    let base = arena.as_ptr().align_offset(HUGE_BYTES).min(huge);
    advise_huge_pages(&arena[base..base + total], false);
    let mut placed = Vec::with_capacity(mats.len());
    let mut at = base;
    for (t, slot) in mats.iter_mut().zip(&slots) {
        let data = t.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>()?;
        arena[at..at + data.len()].copy_from_slice(&data);
        placed.push((at, t.shape().clone()));
        // Drop the original now, not after the loop: loading then holds the weights about
        // once plus one matrix, not twice (a 1.4B model on CPU is 2.8 GB of bf16).
        **t = Tensor::zeros((), T::DTYPE, &device)?;
        drop(data);
        release_free_memory();
        at += slot;
    }
    advise_huge_pages(&arena[base..base + total], true);
    let len = arena.len();
    let arena = Tensor::from_vec(arena, len, &device)?;
    for (t, (start, shape)) in mats.iter_mut().zip(placed) {
        **t = arena.narrow(0, start, shape.elem_count())?.reshape(shape)?;
    }
    Ok(())
}
