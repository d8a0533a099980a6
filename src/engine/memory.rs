//! Where the host path's weights live in memory: one arena of huge pages that the weight
//! matrices are copied into (`into_arena`, for `model::Weights::aligned_for_host`), and
//! handing freed heap memory back to the kernel while loading; and whether a GPU has room for
//! a checkpoint's weights before they are loaded (`check_device_room`, for the loaders). Best effort everywhere: a system without either loses nothing else.

use candle_core::{DType, Shape, Tensor};

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
/// they are loaded, so that a model too large for a GPU, or for the machine's memory, is one
/// line naming both sizes instead of a failed allocation (or the OOM killer) halfway through
/// the load. Metal, and a system that does not say what it has: nothing to check.
pub fn check_device_room(
    device: &candle_core::Device,
    config: &super::looped::LoopedConfig,
    dtype: DType,
    what: &std::path::Path,
) -> super::error::Result<()> {
    let bytes = weight_bytes(config, dtype);
    // A host model's first load times its steps over two KV caches of the positions they read
    // (`model::timing::choose_prefetch`): counted here, before the weights are read.
    let timing = 2 * kv_cache_bytes(config, TIMING_POSITIONS, 4);
    let gb = |b: usize| b as f64 / 1e9;
    if let (true, Some(available)) = (device.is_cpu(), available_memory_bytes())
        && bytes.saturating_add(timing) > available
    {
        return Err(super::EngineError::file(
            what,
            format!(
                "the weights need {:.2} GB in {dtype:?} (and {:.2} GB of KV caches to time its \
                 steps) and this machine has {:.2} GB of memory available",
                gb(bytes),
                gb(timing),
                gb(available)
            ),
        ));
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
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
    Ok(())
}

/// The positions the load-time step timing's KV caches hold (`model::timing`).
pub const TIMING_POSITIONS: usize = 65;

/// The bytes of a checkpoint's weights in `dtype` (saturating: the sizes are bounded by
/// `config::FIELD_LIMITS`, not their product).
pub fn weight_bytes(config: &super::looped::LoopedConfig, dtype: DType) -> usize {
    (super::format::checkpoint_tensors(config).iter())
        .map(|t| t.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d)))
        .fold(0usize, usize::saturating_add)
        .saturating_mul(dtype.size_in_bytes())
}

/// The bytes of a KV cache of `positions` per pass for every (pass, layer) of `config`, K and
/// V, in elements of `element_bytes` (saturating).
pub fn kv_cache_bytes(
    config: &super::looped::LoopedConfig,
    positions: usize,
    element_bytes: usize,
) -> usize {
    [
        config.layers,
        config.passes,
        positions,
        config.kv_dim(),
        2,
        element_bytes,
    ]
    .into_iter()
    .fold(1usize, usize::saturating_mul)
}

/// Errors unless this machine has `bytes` of memory available for `what` (a buffer's name,
/// with its shape), before the buffer is allocated: one line naming both sizes instead of an
/// abort. A system that does not say what it has: nothing to check.
pub fn check_host_room(what: &str, bytes: usize) -> super::error::Result<()> {
    match available_memory_bytes() {
        Some(available) if bytes > available => Err(super::EngineError::Invalid(format!(
            "{what} needs {:.2} GB and this machine has {:.2} GB of memory available",
            bytes as f64 / 1e9,
            available as f64 / 1e9
        ))),
        _ => Ok(()),
    }
}

/// [`check_host_room`] for a run's KV cache of `capacity` positions a pass, which takes `bytes`
/// in its backend's layout.
pub fn check_kv_cache_room(capacity: usize, bytes: usize) -> super::error::Result<()> {
    check_host_room(&format!("a KV cache of {capacity} positions"), bytes)
}

/// Errors unless the weights of `shape`, `weight_copies` times over in f32 (a trainer's
/// parameters, gradients and two moments; a builder's draws and stored copy), fit in the
/// memory available; `what` names the source of the shape.
pub fn check_shape_room(
    shape: &super::config::ModelShape,
    weight_copies: usize,
    what: &std::path::Path,
) -> super::error::Result<()> {
    let config = shape.looped(shape.vocab, DType::F32);
    let bytes = weight_bytes(&config, DType::F32).saturating_mul(weight_copies);
    check_host_room(&format!("{}: the model's weights", what.display()), bytes)
}

/// The memory this process can still take: Linux's MemAvailable (free memory plus what the
/// page cache can give back), at most what its cgroup's limit leaves. `None` elsewhere.
fn available_memory_bytes() -> Option<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = (meminfo.lines())
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<usize>()
        .ok()?;
    let read = |f: &str| {
        let text = std::fs::read_to_string(format!("/sys/fs/cgroup/{f}")).ok()?;
        text.trim().parse::<usize>().ok()
    };
    let cgroup_room = read("memory.max").zip(read("memory.current"));
    let room = cgroup_room.map_or(usize::MAX, |(max, used)| max.saturating_sub(used));
    Some((kb * 1024).min(room))
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
/// are converted to it, which a checkpoint loaded in one dtype never needs). Each tensor
/// becomes a view into the arena ([`Arena`]).
pub fn into_arena(mats: &mut [&mut Tensor]) -> candle_core::Result<()> {
    match mats.first().map(|t| t.dtype()) {
        None => Ok(()),
        Some(DType::BF16) => into_arena_of::<half::bf16>(mats),
        Some(DType::F16) => into_arena_of::<half::f16>(mats),
        Some(_) => into_arena_of::<f32>(mats),
    }
}

/// [`into_arena`] with elements `T`.
fn into_arena_of<T: ArenaElement>(mats: &mut [&mut Tensor]) -> candle_core::Result<()> {
    let Some(device) = mats.first().map(|t| t.device().clone()) else {
        return Ok(());
    };
    let shapes: Vec<Shape> = mats.iter().map(|t| t.shape().clone()).collect();
    let mut arena = Arena::<T>::new(&shapes)?;
    for (i, t) in mats.iter_mut().enumerate() {
        let data = t.flatten_all()?.to_dtype(T::DTYPE)?.to_vec1::<T>()?;
        arena.slot_mut(i).copy_from_slice(&data);
        // Drop the original now, not after the loop: loading then holds the weights about
        // once plus one matrix, not twice.
        **t = Tensor::zeros((), T::DTYPE, &device)?;
        drop(data);
        release_free_memory();
    }
    for (t, view) in mats.iter_mut().zip(arena.finish(&device)?) {
        **t = view;
    }
    Ok(())
}

/// An element an arena holds: a candle dtype whose every bit pattern is a value (f32, bf16,
/// f16, and the bytes of quantized blocks), so a file's bytes can be read straight into it.
pub trait ArenaElement: candle_core::WithDType + bytemuck::Pod {}
impl ArenaElement for f32 {}
impl ArenaElement for half::bf16 {}
impl ArenaElement for half::f16 {}
/// Quantized blocks, as bytes (`gguf`).
impl ArenaElement for u8 {}

/// Weight matrices in one allocation: it starts on a 2 MB boundary and is offered to the
/// kernel as huge pages (a step's weights then need a handful of TLB entries, not thousands),
/// every matrix starts on a 64-byte boundary (no 16-float load straddles two cache lines), and
/// its pages are zeroed by the kernel on first touch, so filling it (from a file, or from a
/// tensor freed right after) never holds the weights twice.
pub struct Arena<T> {
    data: Vec<T>,
    slots: Vec<(usize, Shape)>,
    /// Where the first slot starts (the 2 MB boundary) and the slots' total length.
    base: usize,
    total: usize,
}

impl<T: ArenaElement> Arena<T> {
    /// An arena with one zeroed slot per shape, in order; an error naming the size if the
    /// memory cannot be had.
    pub fn new(shapes: &[Shape]) -> candle_core::Result<Self> {
        const HUGE_BYTES: usize = 2 << 20;
        let size = std::mem::size_of::<T>();
        let (huge, line) = (HUGE_BYTES / size, 64 / size);
        let lens: Vec<usize> = shapes.iter().map(|s| s.elem_count()).collect();
        let total: usize = lens.iter().map(|n| n.div_ceil(line) * line).sum();
        // Free memory at the heap's top first: glibc serves even a request past its mmap
        // threshold from the top where it has room (spex keeps a large top pad), and then
        // clears it with `memset`, faulting in small pages that `finish` must copy into huge
        // ones. With the top trimmed the arena is a fresh mapping: untouched, and huge pages
        // from its first write.
        release_free_memory();
        let data = bytemuck::try_zeroed_vec::<T>(total + huge).map_err(|()| {
            candle_core::Error::Msg(format!(
                "cannot allocate {:.2} GB for the weights",
                ((total + huge) * size) as f64 / 1e9
            ))
        })?;
        let base = data.as_ptr().align_offset(HUGE_BYTES).min(huge);
        advise_huge_pages(&data[base..base + total], false);
        let mut at = base;
        let slots = (shapes.iter().zip(&lens))
            .map(|(shape, &len)| {
                let start = at;
                at += len.div_ceil(line) * line;
                (start, shape.clone())
            })
            .collect();
        Ok(Self {
            data,
            slots,
            base,
            total,
        })
    }

    /// Slot `i`'s elements, to fill.
    pub fn slot_mut(&mut self, i: usize) -> &mut [T] {
        let (start, shape) = &self.slots[i];
        &mut self.data[*start..*start + shape.elem_count()]
    }

    /// The filled arena as one tensor on `device`, and each slot as a view of its shape.
    pub fn finish(self, device: &candle_core::Device) -> candle_core::Result<Vec<Tensor>> {
        advise_huge_pages(&self.data[self.base..self.base + self.total], true);
        let len = self.data.len();
        let arena = Tensor::from_vec(self.data, len, device)?;
        (self.slots.into_iter())
            .map(|(start, shape)| arena.narrow(0, start, shape.elem_count())?.reshape(shape))
            .collect()
    }
}
