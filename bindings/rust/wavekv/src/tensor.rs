use crate::element::{Dtype, Element};
use crate::error::{fail, Result, Status};

/// The strides of a `[outer][inner][head_dim]` tensor, in elements (not
/// bytes), as wavekv.h counts them: `outer` between consecutive tokens (or
/// sequences), `inner` between consecutive heads. 0 means packed
/// (`inner * n_inner` and `head_dim`). The `head_dim` elements of a row are
/// always contiguous.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Elements between consecutive tokens (append) or sequences (q, out).
    pub outer: i64,
    /// Elements between consecutive heads.
    pub inner: i64,
}

impl Strides {
    /// Packed: rows one after another.
    pub const PACKED: Strides = Strides { outer: 0, inner: 0 };

    /// Strides of `outer` and `inner` elements.
    pub fn new(outer: i64, inner: i64) -> Strides {
        Strides { outer, inner }
    }
}

/// The model shape and device every length check needs; copied from the
/// engine into its sequences and plans, which outlive it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub n_layers: u32,
    pub n_q_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: Dtype,
    pub device: u32,
}

pub(crate) fn check_dtype<T: Element>(func: &str, what: &str, shape: &Shape) -> Result<()> {
    if T::DTYPE != shape.dtype {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} holds {} elements but the engine's dtype is {}",
                func,
                what,
                T::DTYPE.name(),
                shape.dtype.name()
            ),
        );
    }
    Ok(())
}

/// The elements a `[n_outer][n_inner][d]` tensor with these non-negative
/// strides reaches, from its first to the end of its last row (0 strides:
/// packed).
fn extent(n_outer: u64, n_inner: u64, d: u64, strides: Strides) -> u128 {
    let inner = if strides.inner == 0 {
        d as u128
    } else {
        strides.inner as u128
    };
    let outer = if strides.outer == 0 {
        n_inner as u128 * inner
    } else {
        strides.outer as u128
    };
    if n_outer == 0 || n_inner == 0 {
        0
    } else {
        (n_outer as u128 - 1) * outer + (n_inner as u128 - 1) * inner + d as u128
    }
}

/// Checks that a slice of `len` elements holds every row of a
/// `[n_outer][n_inner][d]` tensor with these strides, so that the library
/// never reads or writes past it. Negative strides are refused here (the
/// library refuses them too); overlapping rows are left to the library,
/// which refuses them, since they stay inside the slice.
pub(crate) fn check_span(
    func: &str,
    what: &str,
    len: usize,
    n_outer: u64,
    n_inner: u64,
    d: u64,
    strides: Strides,
) -> Result<()> {
    if strides.outer < 0 || strides.inner < 0 {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} strides ({}, {} elements) must not be negative",
                func, what, strides.outer, strides.inner
            ),
        );
    }
    let need = extent(n_outer, n_inner, d, strides);
    if (len as u128) < need {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} has {} elements, fewer than the {} that [{}][{}][{}] with strides ({}, {}) spans",
                func, what, len, need, n_outer, n_inner, d, strides.outer, strides.inner
            ),
        );
    }
    Ok(())
}

/// [`check_span`] for a batch: `n_seqs` tensors `[n_outer][n_inner][d]`
/// with these strides, sequence i's beginning `i * seq_stride` elements in
/// (0: one sequence's extent, the sequences one after another, as the
/// library reads it). Any other `seq_stride` is fine, one smaller than a
/// sequence's rows too (sequences interleaved by token): the slices are
/// only read.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_batch_span(
    func: &str,
    what: &str,
    len: usize,
    n_seqs: u64,
    n_outer: u64,
    n_inner: u64,
    d: u64,
    seq_stride: i64,
    strides: Strides,
) -> Result<()> {
    if seq_stride < 0 || strides.outer < 0 || strides.inner < 0 {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} strides ({}, {}, {} elements) must not be negative",
                func, what, seq_stride, strides.outer, strides.inner
            ),
        );
    }
    let one = extent(n_outer, n_inner, d, strides);
    let between = if seq_stride == 0 {
        one
    } else {
        seq_stride as u128
    };
    let need = if n_seqs == 0 || one == 0 {
        0
    } else {
        (n_seqs as u128 - 1) * between + one
    };
    if (len as u128) < need {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} has {} elements, fewer than the {} that [{}][{}][{}][{}] with strides ({}, {}, {}) spans",
                func, what, len, need, n_seqs, n_outer, n_inner, d, seq_stride, strides.outer, strides.inner
            ),
        );
    }
    Ok(())
}

/// The number of rows of `row` elements in a packed slice, which must hold a
/// positive whole number of them.
pub(crate) fn packed_rows(
    func: &str,
    what: &str,
    len: usize,
    row: usize,
    row_name: &str,
) -> Result<u64> {
    if len == 0 || row == 0 || len % row != 0 {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} has {} elements, not a positive multiple of {} ({} elements)",
                func, what, len, row_name, row
            ),
        );
    }
    Ok((len / row) as u64)
}

/// Checks a packed slice's length against an exact element count.
pub(crate) fn check_len(func: &str, what: &str, len: usize, want: u64, shape: &str) -> Result<()> {
    if len as u64 != want {
        return fail(
            Status::InvalidArgument,
            format!(
                "{}: {} has {} elements, not the {} of {}",
                func, what, len, want, shape
            ),
        );
    }
    Ok(())
}
