use std::fmt;
use std::marker::PhantomData;
use std::mem;
use std::os::raw::c_void;
use std::ptr;
use std::slice;

use wavekv_sys as sys;

use crate::element::{Dtype, Element};
use crate::engine::Sequence;
use crate::error::{check, fail, Result, Status};
use crate::tensor::{check_dtype, check_len, check_span, Shape, Strides};

/// The reusable state of decoding steps (`wkv_plan`). Dropping it, or
/// [`Plan::close`], destroys the handle.
///
/// `Send` but not `Sync`: wavekv.h requires that each plan is used by one
/// thread at a time, and every call takes `&mut self`.
///
/// Two ways to run a step: [`Plan::decode`] (lookup, assemble, attend and
/// update in one call), or [`Plan::lookup`], which returns a [`Step`] for
/// attending with your own kernel. On a CUDA engine, [`Plan::bind`] readies
/// a step that a runtime captures into a CUDA graph of its own (0.9).
pub struct Plan {
    raw: *mut sys::wkv_plan,
    shape: Shape,
    // The batch's handles, reused so that steady decoding does not allocate.
    batch: Vec<*mut sys::wkv_seq>,
}

// SAFETY: the handle may move between threads; without Sync, and with
// &mut self on every call, only one thread at a time can reach it.
unsafe impl Send for Plan {}

impl Plan {
    pub(crate) fn from_raw(raw: *mut sys::wkv_plan, shape: Shape) -> Plan {
        Plan {
            raw,
            shape,
            batch: Vec::new(),
        }
    }

    fn live(&self, func: &str) -> Result<*mut sys::wkv_plan> {
        if self.raw.is_null() {
            return fail(
                Status::InvalidHandle,
                format!("{}: the plan is closed", func),
            );
        }
        Ok(self.raw)
    }

    /// Destroys the handle now rather than when dropped (a bound plan is
    /// unbound first, waiting for the whole device). Again is a no-op;
    /// every later call returns [`Status::InvalidHandle`].
    pub fn close(&mut self) {
        // SAFETY: raw is a live handle or null, which is a no-op.
        unsafe { sys::wkv_plan_destroy(self.raw) };
        self.raw = ptr::null_mut();
    }

    /// Whether [`Plan::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.raw.is_null()
    }

    // Checks the plan and the sequences and fills self.batch; returns the
    // plan's handle and n_seqs.
    fn gather(&mut self, func: &str, seqs: &[&Sequence]) -> Result<(*mut sys::wkv_plan, u32)> {
        let raw = self.live(func)?;
        if seqs.len() > u32::MAX as usize {
            return fail(
                Status::InvalidArgument,
                format!("{}: {} sequences", func, seqs.len()),
            );
        }
        self.batch.clear();
        for (i, s) in seqs.iter().enumerate() {
            match s.live(func) {
                Ok(h) => self.batch.push(h),
                Err(_) => {
                    return fail(
                        Status::InvalidHandle,
                        format!("{}: sequence {} of the batch is closed", func, i),
                    )
                }
            }
        }
        Ok((raw, seqs.len() as u32))
    }

    fn rows(&self, n_seqs: u32) -> u64 {
        n_seqs as u64 * self.shape.n_q_heads as u64 * self.shape.head_dim as u64
    }

    /// One decoding step at one layer for a batch of sequences
    /// (`wkv_decode`): `q` and `out` are packed
    /// `[seqs.len()][n_q_heads][head_dim]`.
    pub fn decode<T: Element>(
        &mut self,
        seqs: &[&Sequence],
        layer: u32,
        q: &[T],
        out: &mut [T],
    ) -> Result<()> {
        const F: &str = "wkv_decode";
        let (raw, n) = self.gather(F, seqs)?;
        check_dtype::<T>(F, "q", &self.shape)?;
        let want = self.rows(n);
        check_len(F, "q", q.len(), want, "[n_seqs][n_q_heads][head_dim]")?;
        check_len(F, "out", out.len(), want, "[n_seqs][n_q_heads][head_dim]")?;
        // SAFETY: live handles; q and out hold the packed tensors; q is
        // copied and out written during the call (a CPU engine).
        check(unsafe {
            sys::wkv_decode(
                raw,
                self.batch.as_ptr(),
                n,
                layer,
                q.as_ptr() as *const c_void,
                0,
                0,
                out.as_mut_ptr() as *mut c_void,
                0,
                0,
                ptr::null_mut(),
            )
        })
    }

    /// [`Plan::decode`] with explicit strides (in elements) for q and out.
    pub fn decode_strided<T: Element>(
        &mut self,
        seqs: &[&Sequence],
        layer: u32,
        q: &[T],
        q_strides: Strides,
        out: &mut [T],
        out_strides: Strides,
    ) -> Result<()> {
        const F: &str = "wkv_decode";
        let (raw, n) = self.gather(F, seqs)?;
        check_dtype::<T>(F, "q", &self.shape)?;
        let (nq, d) = (self.shape.n_q_heads as u64, self.shape.head_dim as u64);
        check_span(F, "q", q.len(), n as u64, nq, d, q_strides)?;
        check_span(F, "out", out.len(), n as u64, nq, d, out_strides)?;
        // SAFETY: as in decode; the spans are checked above.
        check(unsafe {
            sys::wkv_decode(
                raw,
                self.batch.as_ptr(),
                n,
                layer,
                q.as_ptr() as *const c_void,
                q_strides.outer,
                q_strides.inner,
                out.as_mut_ptr() as *mut c_void,
                out_strides.outer,
                out_strides.inner,
                ptr::null_mut(),
            )
        })
    }

    /// `wkv_decode` with raw pointers and a stream, for CUDA engines.
    ///
    /// # Safety
    /// `q` and `out` must point to memory on the engine's device holding the
    /// tensors the strides describe, valid until the step completes on
    /// `stream`; `stream` must be null or a live stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_raw(
        &mut self,
        seqs: &[&Sequence],
        layer: u32,
        q: *const c_void,
        q_strides: Strides,
        out: *mut c_void,
        out_strides: Strides,
        stream: *mut c_void,
    ) -> Result<()> {
        let (raw, n) = self.gather("wkv_decode", seqs)?;
        check(sys::wkv_decode(
            raw,
            self.batch.as_ptr(),
            n,
            layer,
            q,
            q_strides.outer,
            q_strides.inner,
            out,
            out_strides.outer,
            out_strides.inner,
            stream,
        ))
    }

    /// Binds the plan to a batch for a decoding step that a runtime captures
    /// into a CUDA graph and replays, each replay after a [`Plan::prepare`]
    /// (`wkv_plan_bind`, 0.9): `seqs` are distinct sequences of the plan's
    /// engine, every layer holding tokens, in the order the captured
    /// `wkv_append_batch` and `wkv_decode` calls will list them, for
    /// `max_steps` more tokens each (0: 4096); on the default stream.
    /// CUDA engines without cold pages only: a CPU engine returns
    /// [`Status::Unsupported`]. While bound, the sequences refuse every other
    /// append, lookup, prompt end, save and eviction, and the plan every
    /// other step ([`Status::State`]), until [`Plan::unbind`].
    pub fn bind(&mut self, seqs: &[&Sequence], max_steps: u32) -> Result<()> {
        // SAFETY: the null stream is the default stream.
        unsafe { self.bind_raw(seqs, max_steps, ptr::null_mut()) }
    }

    /// [`Plan::bind`] on a CUDA stream, which it waits for (the sequences'
    /// prompts are ended as a lookup would end them).
    ///
    /// # Safety
    /// `stream` must be null or a live stream of the engine's device.
    pub unsafe fn bind_raw(
        &mut self,
        seqs: &[&Sequence],
        max_steps: u32,
        stream: *mut c_void,
    ) -> Result<()> {
        let (raw, n) = self.gather("wkv_plan_bind", seqs)?;
        check(sys::wkv_plan_bind(
            raw,
            self.batch.as_ptr(),
            n,
            max_steps,
            stream,
        ))
    }

    /// Prepares the next replay of the bound plan's captured step
    /// (`wkv_plan_prepare`, 0.9), on the default stream: launch the graph
    /// once after each prepare, on the same stream. [`Status::State`] when
    /// the plan is not bound, nothing is captured or the device found a
    /// fault; [`Status::Budget`] once `max_steps` steps are prepared. On an
    /// error the graph must not be launched for the step.
    pub fn prepare(&mut self) -> Result<()> {
        // SAFETY: the null stream is the default stream.
        unsafe { self.prepare_raw(ptr::null_mut()) }
    }

    /// [`Plan::prepare`] on a CUDA stream: the one the graph is launched on.
    ///
    /// # Safety
    /// `stream` must be null or a live stream of the engine's device.
    pub unsafe fn prepare_raw(&mut self, stream: *mut c_void) -> Result<()> {
        let raw = self.live("wkv_plan_prepare")?;
        check(sys::wkv_plan_prepare(raw, stream))
    }

    /// Ends the binding (`wkv_plan_unbind`, 0.9), on the default stream: waits
    /// for the replays, takes back the tokens of steps prepared and never
    /// replayed, and frees the sequences and the plan for other use; a graph
    /// captured under the binding faults if replayed later.
    /// [`Status::State`] when the plan is not bound. Dropping or closing a
    /// bound plan unbinds it, waiting for the whole device.
    pub fn unbind(&mut self) -> Result<()> {
        // SAFETY: the null stream is the default stream.
        unsafe { self.unbind_raw(ptr::null_mut()) }
    }

    /// [`Plan::unbind`] on a CUDA stream (the replays').
    ///
    /// # Safety
    /// `stream` must be null or a live stream of the engine's device.
    pub unsafe fn unbind_raw(&mut self, stream: *mut c_void) -> Result<()> {
        let raw = self.live("wkv_plan_unbind")?;
        check(sys::wkv_plan_unbind(raw, stream))
    }

    /// Lookup (`wkv_lookup`): selects the zones of each sequence at one
    /// layer for the packed queries `q` (`[seqs.len()][n_q_heads][head_dim]`)
    /// and returns the step, through which the rest of it runs. The step
    /// borrows the sequences, so none can be appended to before the step is
    /// done.
    pub fn lookup<'p, 's, T: Element>(
        &'p mut self,
        seqs: &[&'s Sequence],
        layer: u32,
        q: &[T],
    ) -> Result<Step<'p, 's>> {
        self.lookup_strided(seqs, layer, q, Strides::PACKED)
    }

    /// [`Plan::lookup`] with explicit strides for q.
    pub fn lookup_strided<'p, 's, T: Element>(
        &'p mut self,
        seqs: &[&'s Sequence],
        layer: u32,
        q: &[T],
        q_strides: Strides,
    ) -> Result<Step<'p, 's>> {
        const F: &str = "wkv_lookup";
        let (raw, n) = self.gather(F, seqs)?;
        check_dtype::<T>(F, "q", &self.shape)?;
        let (nq, d) = (self.shape.n_q_heads as u64, self.shape.head_dim as u64);
        if q_strides == Strides::PACKED {
            check_len(
                F,
                "q",
                q.len(),
                self.rows(n),
                "[n_seqs][n_q_heads][head_dim]",
            )?;
        } else {
            check_span(F, "q", q.len(), n as u64, nq, d, q_strides)?;
        }
        // SAFETY: live handles; q is copied during the call.
        check(unsafe {
            sys::wkv_lookup(
                raw,
                self.batch.as_ptr(),
                n,
                layer,
                q.as_ptr() as *const c_void,
                q_strides.outer,
                q_strides.inner,
                ptr::null_mut(),
            )
        })?;
        Ok(Step {
            plan: self,
            n_seqs: n,
            _seqs: PhantomData,
        })
    }

    /// The raw handle, for calls this crate does not wrap; null once closed.
    /// It stays owned by the `Plan`.
    pub fn as_raw(&self) -> *mut sys::wkv_plan {
        self.raw
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan").field("raw", &self.raw).finish()
    }
}

/// A decoding step after its lookup: assemble, then attend (wavekv's own
/// kernel) or run your kernel over [`Step::xbuf`] and [`Step::merge`]; then
/// update. Holds the plan mutably and the step's sequences shared, which is
/// what wavekv.h asks: no other use of the plan, no append to a sequence of
/// the step.
pub struct Step<'p, 's> {
    plan: &'p mut Plan,
    n_seqs: u32,
    _seqs: PhantomData<&'s Sequence>,
}

impl<'p, 's> Step<'p, 's> {
    /// Sequences in the step.
    pub fn n_seqs(&self) -> u32 {
        self.n_seqs
    }

    fn raw(&self, func: &str) -> Result<*mut sys::wkv_plan> {
        self.plan.live(func)
    }

    fn out_len(&self) -> u64 {
        self.plan.rows(self.n_seqs)
    }

    /// Lays out the exact part in the plan's execution buffer
    /// (`wkv_assemble`).
    pub fn assemble(&mut self) -> Result<()> {
        let raw = self.raw("wkv_assemble")?;
        check(unsafe { sys::wkv_assemble(raw, ptr::null_mut()) })
    }

    /// `wkv_assemble` on a CUDA stream.
    ///
    /// # Safety
    /// `stream` must be null or a live stream of the engine's device.
    pub unsafe fn assemble_raw(&mut self, stream: *mut c_void) -> Result<()> {
        let raw = self.raw("wkv_assemble")?;
        check(sys::wkv_assemble(raw, stream))
    }

    /// The execution buffer as host slices (CPU engines), valid while the
    /// step is borrowed: a new assemble or lookup needs `&mut`.
    pub fn xbuf<T: Element>(&self) -> Result<Xbuf<'_, T>> {
        const F: &str = "wkv_plan_xbuf";
        let shape = self.plan.shape;
        if shape.device != sys::WKV_DEVICE_CPU {
            return fail(
                Status::Unsupported,
                format!(
                    "{}: host slices need a CPU engine; xbuf_raw gives device pointers",
                    F
                ),
            );
        }
        check_dtype::<T>(F, "the slices", &shape)?;
        let view = self.xbuf_raw()?;
        if Dtype::from_raw(view.dtype) != Some(T::DTYPE) || view.head_dim != shape.head_dim {
            return fail(
                Status::Internal,
                format!(
                    "{}: the view's dtype {} / head_dim {} differ from the engine's",
                    F, view.dtype, view.head_dim
                ),
            );
        }
        let n = (view.n_tokens as usize).checked_mul(view.head_dim as usize);
        let n = match n {
            Some(n) => n,
            None => return fail(Status::Internal, format!("{}: {} tokens", F, view.n_tokens)),
        };
        // SAFETY: on a CPU engine the view's pointers are host memory the
        // plan owns, [n_tokens][head_dim] and [n_runs + 1], valid until its
        // next lookup or assemble, which need &mut self.
        unsafe {
            Ok(Xbuf {
                n_runs: view.n_runs,
                head_dim: view.head_dim,
                k: raw_slice(view.k as *const T, n),
                v: raw_slice(view.v as *const T, n),
                offsets: raw_slice(view.offsets, view.n_runs as usize + 1),
            })
        }
    }

    /// The execution buffer's raw view (`wkv_plan_xbuf`); on a CUDA engine
    /// its pointers are device pointers.
    pub fn xbuf_raw(&self) -> Result<sys::wkv_xbuf_view> {
        let raw = self.raw("wkv_plan_xbuf")?;
        // SAFETY: plain data, filled by wkv_xbuf_view_init and the library.
        let mut view: sys::wkv_xbuf_view = unsafe { mem::zeroed() };
        unsafe { sys::wkv_xbuf_view_init(&mut view) };
        check(unsafe { sys::wkv_plan_xbuf(raw, &mut view) })?;
        Ok(view)
    }

    /// Exact attention over the execution buffer merged with the estimate
    /// (`wkv_attend`): `out` is packed `[n_seqs][n_q_heads][head_dim]`;
    /// `lse`, if given, receives `[n_seqs][n_q_heads]` log-sum-exps.
    pub fn attend<T: Element>(&mut self, out: &mut [T], lse: Option<&mut [f32]>) -> Result<()> {
        self.attend_strided(out, Strides::PACKED, lse)
    }

    /// [`Step::attend`] with explicit strides for out.
    pub fn attend_strided<T: Element>(
        &mut self,
        out: &mut [T],
        strides: Strides,
        lse: Option<&mut [f32]>,
    ) -> Result<()> {
        const F: &str = "wkv_attend";
        let raw = self.raw(F)?;
        let shape = self.plan.shape;
        check_dtype::<T>(F, "out", &shape)?;
        self.check_out(F, out.len(), strides)?;
        let lse_ptr = match lse {
            None => ptr::null_mut(),
            Some(l) => {
                let want = self.n_seqs as u64 * shape.n_q_heads as u64;
                check_len(F, "lse", l.len(), want, "[n_seqs][n_q_heads]")?;
                l.as_mut_ptr()
            }
        };
        // SAFETY: live plan; out and lse checked to hold what is written.
        check(unsafe {
            sys::wkv_attend(
                raw,
                out.as_mut_ptr() as *mut c_void,
                strides.outer,
                strides.inner,
                lse_ptr,
                ptr::null_mut(),
            )
        })
    }

    fn check_out(&self, func: &str, len: usize, strides: Strides) -> Result<()> {
        let shape = self.plan.shape;
        if strides == Strides::PACKED {
            check_len(
                func,
                "out",
                len,
                self.out_len(),
                "[n_seqs][n_q_heads][head_dim]",
            )
        } else {
            check_span(
                func,
                "out",
                len,
                self.n_seqs as u64,
                shape.n_q_heads as u64,
                shape.head_dim as u64,
                strides,
            )
        }
    }

    /// Folds the estimate into an output you attended yourself over the
    /// execution buffer (`wkv_merge`): `out` packed as in attend and `lse`
    /// its `[n_seqs][n_q_heads]` natural log-sum-exps of scaled scores, both
    /// updated in place.
    pub fn merge<T: Element>(&mut self, out: &mut [T], lse: &mut [f32]) -> Result<()> {
        self.merge_strided(out, Strides::PACKED, lse, 0)
    }

    /// [`Step::merge`] with explicit strides for out, and `lse_seq_stride`
    /// floats between sequences in lse (0 = n_q_heads).
    pub fn merge_strided<T: Element>(
        &mut self,
        out: &mut [T],
        strides: Strides,
        lse: &mut [f32],
        lse_seq_stride: i64,
    ) -> Result<()> {
        const F: &str = "wkv_merge";
        let raw = self.raw(F)?;
        let shape = self.plan.shape;
        check_dtype::<T>(F, "out", &shape)?;
        self.check_out(F, out.len(), strides)?;
        let nq = shape.n_q_heads as u64;
        if lse_seq_stride < 0 {
            return fail(
                Status::InvalidArgument,
                format!(
                    "{}: lse_seq_stride {} must not be negative",
                    F, lse_seq_stride
                ),
            );
        }
        let stride = if lse_seq_stride == 0 {
            nq
        } else {
            lse_seq_stride as u64
        };
        let need = (self.n_seqs as u64).saturating_sub(1) * stride + nq;
        if (lse.len() as u64) < need {
            return fail(
                Status::InvalidArgument,
                format!(
                    "{}: lse has {} floats, fewer than the {} it spans",
                    F,
                    lse.len(),
                    need
                ),
            );
        }
        // SAFETY: live plan; out and lse checked to span what is updated.
        check(unsafe {
            sys::wkv_merge(
                raw,
                out.as_mut_ptr() as *mut c_void,
                strides.outer,
                strides.inner,
                lse.as_mut_ptr(),
                lse_seq_stride,
                ptr::null_mut(),
            )
        })
    }

    /// Hands the step's access record to the buffer manager (`wkv_update`).
    pub fn update(&mut self) -> Result<()> {
        let raw = self.raw("wkv_update")?;
        check(unsafe { sys::wkv_update(raw, ptr::null_mut()) })
    }
}

impl fmt::Debug for Step<'_, '_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Step")
            .field("plan", &self.plan)
            .field("n_seqs", &self.n_seqs)
            .finish()
    }
}

unsafe fn raw_slice<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 || p.is_null() {
        &[]
    } else {
        slice::from_raw_parts(p, n)
    }
}

/// The execution buffer of an assembled step, on the host: one run of tokens
/// per (sequence, KV head), run `r = s * n_kv_heads + h`, K and V each
/// `[tokens][head_dim]` (wavekv.h, `wkv_xbuf_view`).
#[derive(Debug, Clone, Copy)]
pub struct Xbuf<'a, T> {
    /// n_seqs * n_kv_heads.
    pub n_runs: u32,
    /// Elements per token row.
    pub head_dim: u32,
    /// Keys of all runs, `[offsets[n_runs]][head_dim]`.
    pub k: &'a [T],
    /// Values of all runs, likewise.
    pub v: &'a [T],
    /// Run r holds tokens `offsets[r] .. offsets[r + 1]`.
    pub offsets: &'a [i32],
}

impl<'a, T> Xbuf<'a, T> {
    /// The keys and values of run r, or `None` for a run past the last (or
    /// offsets out of order).
    pub fn run(&self, r: usize) -> Option<(&'a [T], &'a [T])> {
        let lo = *self.offsets.get(r)?;
        let hi = *self.offsets.get(r + 1)?;
        if lo < 0 || hi < lo {
            return None;
        }
        let d = self.head_dim as usize;
        let (lo, hi) = (lo as usize * d, hi as usize * d);
        Some((self.k.get(lo..hi)?, self.v.get(lo..hi)?))
    }
}
