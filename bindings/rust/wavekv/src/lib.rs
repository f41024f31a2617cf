//! A safe Rust API over libwavekv, a KV-cache storage engine for
//! long-context LLM inference. The C header `include/wavekv/wavekv.h` is the
//! manual; this crate maps it as follows.
//!
//! - Handles are owners: [`Engine`], [`Sequence`] and [`Plan`] close their
//!   handle when dropped. Each also has `close(&mut self)` for releasing
//!   early; any later call returns an [`Error`] with
//!   [`Status::InvalidHandle`], never undefined behaviour.
//! - Sequences and plans do not borrow the engine: wavekv.h lets them outlive
//!   the engine handle, so they are plain owned values.
//! - Every fallible call returns [`Result`]; the [`Error`] carries the
//!   [`Status`] and the message, copied from `wkv_last_error` at once.
//! - Tensors are slices of the engine's element type ([`f32`], [`F16`] or
//!   [`Bf16`]), packed or with explicit [`Strides`] in elements. Their
//!   lengths are checked against the shape before the library is called.
//! - Threads: [`Engine`] is `Send + Sync` (wavekv.h lets several threads use
//!   an engine at once); [`Sequence`] and [`Plan`] are `Send` but not `Sync`
//!   (each may be used by one thread at a time).
//! - CUDA engines take device pointers and streams through the `unsafe`
//!   `*_raw` methods.
//!
//! A sequence is not `Sync`, so a `&Sequence` cannot be shared with another
//! thread:
//!
//! ```compile_fail,E0277
//! fn shared<T: Sync>(_: &T) {}
//! fn check(seq: &wavekv::Sequence) { shared(seq) }
//! ```
//!
//! and a step borrows its sequences, so none is appended to between the
//! lookup and the end of the step:
//!
//! ```compile_fail,E0502
//! fn step(plan: &mut wavekv::Plan, seq: &mut wavekv::Sequence, q: &[f32], k: &[f32]) {
//!     let mut step = plan.lookup(&[&*seq], 0, q).unwrap();
//!     seq.append(0, k, k).unwrap();
//!     step.assemble().unwrap();
//! }
//! ```
//!
//! The batch append ([`Sequence::append_batch`]) takes its sequences as
//! `&mut`, so that the same holds for it, and a sequence cannot be listed
//! twice:
//!
//! ```compile_fail,E0502
//! use wavekv::{Plan, Sequence};
//! fn step(plan: &mut Plan, a: &mut Sequence, b: &mut Sequence, q: &[f32], k: &[f32]) {
//!     let mut step = plan.lookup(&[&*a], 0, q).unwrap();
//!     Sequence::append_batch(&mut [&mut *a, &mut *b], 0, k, k).unwrap();
//!     step.assemble().unwrap();
//! }
//! ```
//!
//! ```compile_fail,E0499
//! fn twice(a: &mut wavekv::Sequence, k: &[f32]) {
//!     wavekv::Sequence::append_batch(&mut [&mut *a, &mut *a], 0, k, k).unwrap();
//! }
//! ```

mod config;
mod element;
mod engine;
mod error;
mod plan;
mod tensor;

use std::ffi::CStr;

pub use wavekv_sys as sys;

pub use crate::config::{Config, Device, PageFormat};
pub use crate::element::{Bf16, Dtype, Element, F16};
pub use crate::engine::{Engine, SeqInfo, Sequence, Stats};
pub use crate::error::{Error, Result, Status};
pub use crate::plan::{Plan, Step, Xbuf};
pub use crate::tensor::Strides;

/// The run-time library's version: (major, minor, patch).
pub fn version() -> (u32, u32, u32) {
    let v = unsafe { sys::wkv_version() }.max(0) as u32;
    (v / 10000, v / 100 % 100, v % 100)
}

/// The run-time library's version as "major.minor.patch".
pub fn version_string() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(sys::wkv_version_string()) }
        .to_string_lossy()
        .into_owned()
}

/// The README's example, run as a doctest so that it keeps working as
/// written.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
