//! A quantized matrix in the kernels' layout, for every block type alike: each whole group of
//! [`GROUP_ROWS`] weight rows interleaved block by block (one `Group` a block: the rows'
//! scales, then their weights a few bytes of each row in turn, so one vector load holds a
//! slice of every row of the group), then the last `rows % 8` rows as GGUF stores them.
//! Called by the Q8_0 (`q8_0`) and K-quant (`k_quants`) kernels, which define the groups, and
//! by the GGUF loader (through [`repack`]).
//!
//! Why interleaved: a vector's lanes are then 8 weight rows, so an integer dot product adds
//! into each row's own lane and one FMA a block scales 8 outputs; with rows as stored every
//! block's lanes had to be reduced and scaled apart. (llama.cpp's CPU backend repacks alike.)
//! The layout moves bytes only: a group takes exactly its rows' blocks' bytes, so a file's
//! size is the arena's.

/// Weight rows a group interleaves.
pub const GROUP_ROWS: usize = 8;

/// A block type and its 8-row interleaved group.
pub trait Interleave: Copy + std::fmt::Debug + 'static {
    /// Which block type it is (its weights a block and bytes a block).
    const KIND: super::QuantKind;
    /// The block as GGUF stores it.
    type Block: bytemuck::Pod + std::fmt::Debug;
    /// One block of each of 8 rows, interleaved.
    type Group: bytemuck::Pod + std::fmt::Debug;

    /// The group of 8 rows' blocks (row `j`'s block is `rows[j]`).
    fn pack(rows: &[Self::Block; GROUP_ROWS]) -> Self::Group;
}

/// Weight-row runs of about this many bytes ([`Packed::runs_by_rows`]).
const RUN_BYTES: usize = 32 << 10;

/// A matrix of `K` blocks in the kernels' layout (module docs).
#[derive(Debug, Clone, Copy)]
pub struct Packed<'a, K: Interleave> {
    /// Each group's blocks in order, group after group.
    pub groups: &'a [K::Group],
    /// The rows after the last whole group, row after row.
    pub tail: &'a [K::Block],
    /// Blocks a row.
    pub blocks: usize,
}

impl<'a, K: Interleave> Packed<'a, K> {
    /// A matrix of `rows` rows of `blocks` blocks held in `bytes` in the module docs' layout;
    /// an error says why not (the size, or an odd address).
    pub fn from_bytes(bytes: &'a [u8], rows: usize, blocks: usize) -> Result<Self, String> {
        let block = std::mem::size_of::<K::Block>();
        if bytes.len() != rows * blocks * block {
            return Err(format!(
                "{} bytes for {rows} rows of {blocks} blocks of {block} bytes",
                bytes.len()
            ));
        }
        let (groups, tail) = bytes.split_at(rows / GROUP_ROWS * GROUP_ROWS * blocks * block);
        let cast = |e: bytemuck::PodCastError| format!("quantized blocks: {e}");
        Ok(Self {
            groups: bytemuck::try_cast_slice(groups).map_err(cast)?,
            tail: bytemuck::try_cast_slice(tail).map_err(cast)?,
            blocks,
        })
    }

    /// Its rows in whole groups.
    pub fn grouped_rows(self) -> usize {
        self.groups.len() / self.blocks.max(1) * GROUP_ROWS
    }

    /// Its rows.
    pub fn rows(self) -> usize {
        self.grouped_rows() + self.tail.len() / self.blocks.max(1)
    }

    /// The bytes it takes.
    pub fn bytes(self) -> usize {
        std::mem::size_of_val(self.groups) + std::mem::size_of_val(self.tail)
    }

    /// Its number of weights.
    pub fn len(self) -> usize {
        self.rows() * self.inner()
    }

    /// Whether it has no weights.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Weights a row.
    pub fn inner(self) -> usize {
        self.blocks * K::KIND.block_weights()
    }

    /// The whole rows that hold weights `range` (which starts at a row's start: the decode
    /// threads' shares do).
    pub fn slice_elements(self, range: std::ops::Range<usize>) -> Self {
        let inner = self.inner().max(1);
        self.slice_rows(range.start / inner..range.end.div_ceil(inner))
    }

    /// Its bytes as aligned 64-bit words (a probe's read: `Weight::words`).
    pub fn words(self) -> &'a [u64] {
        bytemuck::pod_align_to::<u8, u64>(bytemuck::cast_slice(self.groups)).1
    }

    /// Rows `range`, which must start at a multiple of 8 and end at one or at the last row
    /// (the decode threads' shares do).
    pub fn slice_rows(self, range: std::ops::Range<usize>) -> Self {
        debug_assert!(range.start.is_multiple_of(GROUP_ROWS));
        let grouped = self.grouped_rows();
        let (b, g) = (self.blocks, GROUP_ROWS);
        let group_end = range.end.min(grouped);
        let group_start = range.start.min(group_end);
        let tail_start = range.start.max(grouped) - grouped;
        let tail_end = range.end.max(grouped) - grouped;
        Self {
            groups: &self.groups[group_start / g * b..group_end / g * b],
            tail: &self.tail[tail_start * b..tail_end * b],
            blocks: b,
        }
    }

    /// Its whole groups in runs, each run with every block of up to `most` of `rows`
    /// activation rows in turn: `each(first group of the run, the run, rows)`. Where the rows
    /// are one block, one run of every group: the kernel's call and setup are paid once. Else
    /// runs of about [`RUN_BYTES`] and an even number of groups (a VNNI kernel takes two at
    /// once), so a run read once from memory serves the later blocks of rows from L1 and L2.
    pub(super) fn runs_by_rows(
        self,
        rows: usize,
        most: usize,
        mut each: impl FnMut(usize, &'a [K::Group], std::ops::Range<usize>),
    ) {
        let b = self.blocks.max(1);
        let groups = self.groups.len() / b;
        let run_groups = if rows <= most {
            groups.max(1)
        } else {
            (RUN_BYTES / (b * std::mem::size_of::<K::Group>()).max(1))
                .next_multiple_of(2)
                .max(2)
        };
        for start in (0..groups).step_by(run_groups) {
            let run = &self.groups[start * b..(start + run_groups).min(groups) * b];
            for first in (0..rows).step_by(most.max(1)) {
                each(start, run, first..(first + most).min(rows));
            }
        }
    }

    /// Where row `row`'s block `k` lies: in a group (the group's block and the row's place in
    /// it) or in the tail.
    pub fn locate(self, row: usize, k: usize) -> Located<'a, K> {
        let grouped = self.grouped_rows();
        if row >= grouped {
            return Located::Tail(&self.tail[(row - grouped) * self.blocks + k]);
        }
        let item = &self.groups[row / GROUP_ROWS * self.blocks + k];
        Located::Group(item, row % GROUP_ROWS)
    }
}

/// [`Packed::locate`]'s answer.
#[derive(Debug, Clone, Copy)]
pub enum Located<'a, K: Interleave> {
    /// Row `.1` of a group's block.
    Group(&'a K::Group, usize),
    /// A block as stored.
    Tail(&'a K::Block),
}

/// Rewrites `bytes`, `rows` rows of `blocks` `K` blocks as GGUF stores them, into the kernels'
/// layout in place: each whole group of 8 rows as `K::Group`s, one per block, and the rows
/// after the last group as they are.
pub fn repack<K: Interleave>(bytes: &mut [u8], rows: usize, blocks: usize) {
    let block = std::mem::size_of::<K::Block>();
    let group_bytes = GROUP_ROWS * blocks * block;
    for group in bytes[..rows / GROUP_ROWS * group_bytes].chunks_exact_mut(group_bytes) {
        let stored: Vec<K::Block> = bytemuck::pod_collect_to_vec(group);
        let packed: Vec<K::Group> = (0..blocks)
            .map(|k| K::pack(&std::array::from_fn(|j| stored[j * blocks + k])))
            .collect();
        group.copy_from_slice(bytemuck::cast_slice(&packed));
    }
}
