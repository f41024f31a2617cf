use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::fmt;
use std::mem;
use std::os::raw::{c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr;

use wavekv_sys as sys;

use crate::config::{Config, Device};
use crate::element::{Dtype, Element};
use crate::error::{check, fail, Result, Status};
use crate::plan::Plan;
use crate::tensor::{check_batch_span, check_dtype, check_span, packed_rows, Shape, Strides};

/// Statistics of one engine (`wkv_stats`; wavekv.h documents each counter).
pub type Stats = sys::wkv_stats;

/// What one layer of a sequence holds (`wkv_seq_info`).
pub type SeqInfo = sys::wkv_seq_info;

/// An open engine (`wkv_engine`). Dropping it, or [`Engine::close`], closes
/// the handle; sequences and plans made from it keep working (wavekv.h), so
/// they neither borrow it nor keep it alive.
///
/// `Engine` is `Send` and `Sync`: wavekv.h lets several threads use one
/// engine at once, and every method here that reaches the library takes
/// `&self`, except `close`, which takes `&mut self`.
pub struct Engine {
    raw: *mut sys::wkv_engine,
    shape: Shape,
}

// SAFETY: the handle is not tied to a thread, and the library allows
// concurrent use of an engine; closing needs &mut self, so no other thread
// can be using the handle then.
unsafe impl Send for Engine {}
unsafe impl Sync for Engine {}

fn closed<T>(func: &str, what: &str) -> Result<T> {
    fail(
        Status::InvalidHandle,
        format!("{}: the {} is closed", func, what),
    )
}

// A path as the library takes it: its bytes as the OS holds them (no UTF-8
// required), NUL-terminated. A NUL inside would cut the path short in C, so
// that a different file would be opened: refused here instead.
fn c_path(func: &str, path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).or_else(|e| {
        fail(
            Status::InvalidArgument,
            format!(
                "{}: the path {:?} has a NUL byte at {}",
                func,
                path,
                e.nul_position()
            ),
        )
    })
}

impl Engine {
    /// Opens an engine with the paths of `wkv_config` given safely: a
    /// directory for the spill file (`spill_dir`: eviction of sequences,
    /// and on a CPU engine with a host budget, cold pages) and a file for
    /// the published statistics (`stats_path`), each `None` to leave the
    /// config's own. The library copies both at open, so they need not
    /// outlive the call; a path with a NUL byte is refused.
    pub fn open_with_files(
        config: &Config,
        spill_dir: Option<&Path>,
        stats_path: Option<&Path>,
    ) -> Result<Engine> {
        let spill = spill_dir
            .map(|p| c_path("wkv_engine_open", p))
            .transpose()?;
        let stats = stats_path
            .map(|p| c_path("wkv_engine_open", p))
            .transpose()?;
        let mut cfg = *config;
        if let Some(s) = &spill {
            cfg.as_raw_mut().spill_dir = s.as_ptr();
        }
        if let Some(s) = &stats {
            cfg.as_raw_mut().stats_path = s.as_ptr();
        }
        Engine::open(&cfg)
    }

    /// Opens an engine (`wkv_engine_open`). A page format other than
    /// [`PageFormat::Storage`](crate::PageFormat::Storage) needs libwavekv
    /// 0.10 or later ([`PageFormat::Int8Centered`](crate::PageFormat::Int8Centered):
    /// 0.11): an older one gives [`Status::Unsupported`].
    pub fn open(config: &Config) -> Result<Engine> {
        let (major, minor, _) = crate::version();
        // The minor version that brought the page format: an older
        // library's reserved0 (or its check of the value) would refuse it,
        // naming a field or value the caller may not know.
        let since = match config.page_format {
            sys::WKV_PAGE_FORMAT_STORAGE => 0,
            sys::WKV_PAGE_FORMAT_INT8 => 10,
            _ => 11,
        };
        if major == 0 && minor < since {
            return fail(
                Status::Unsupported,
                format!(
                    "wkv_engine_open: page_format {} needs libwavekv 0.{} or later; the one loaded is {}",
                    config.page_format,
                    since,
                    crate::version_string()
                ),
            );
        }
        let mut raw: *mut sys::wkv_engine = ptr::null_mut();
        check(unsafe { sys::wkv_engine_open(config.as_raw(), &mut raw) })?;
        let mut engine = Engine {
            raw,
            shape: Shape {
                n_layers: 0,
                n_q_heads: 0,
                n_kv_heads: 0,
                head_dim: 0,
                dtype: Dtype::F32,
                device: sys::WKV_DEVICE_CPU,
            },
        };
        // The effective configuration (an environment variable may have
        // changed a field) gives the shape that slices are checked against.
        let c = engine.config()?;
        let mut device = 0u32;
        check(unsafe { sys::wkv_engine_device(engine.raw, &mut device) })?;
        let dtype = match Dtype::from_raw(c.dtype) {
            Some(d) => d,
            None => {
                return fail(
                    Status::Unsupported,
                    format!(
                        "wkv_engine_open: dtype {} is unknown to this binding",
                        c.dtype
                    ),
                )
            }
        };
        engine.shape = Shape {
            n_layers: c.n_layers,
            n_q_heads: c.n_q_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            dtype,
            device,
        };
        Ok(engine)
    }

    fn live(&self, func: &str) -> Result<*mut sys::wkv_engine> {
        if self.raw.is_null() {
            return closed(func, "engine");
        }
        Ok(self.raw)
    }

    /// Closes the handle now rather than when dropped. Closing again is a
    /// no-op; every later call that needs the handle returns
    /// [`Status::InvalidHandle`].
    pub fn close(&mut self) {
        // SAFETY: raw is a live handle or null, which is a no-op.
        unsafe { sys::wkv_engine_close(self.raw) };
        self.raw = ptr::null_mut();
    }

    /// Whether [`Engine::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.raw.is_null()
    }

    /// The effective configuration, defaults and environment resolved
    /// (`wkv_engine_config`).
    pub fn config(&self) -> Result<Config> {
        let raw = self.live("wkv_engine_config")?;
        // SAFETY: plain data; the library fills the `size` bytes it is told.
        let mut c: sys::wkv_config = unsafe { mem::zeroed() };
        c.size = mem::size_of::<sys::wkv_config>() as u32;
        check(unsafe { sys::wkv_engine_config(raw, &mut c) })?;
        Ok(Config::from_raw(c))
    }

    /// The backend the engine runs on, as opened.
    pub fn device(&self) -> Device {
        Device::from_raw(self.shape.device).unwrap_or(Device::Auto)
    }

    /// The engine's storage dtype: tensors passed in are slices of its
    /// [`Element`] type.
    pub fn dtype(&self) -> Dtype {
        self.shape.dtype
    }

    /// Model layers.
    pub fn n_layers(&self) -> u32 {
        self.shape.n_layers
    }

    /// Query heads.
    pub fn n_q_heads(&self) -> u32 {
        self.shape.n_q_heads
    }

    /// KV heads.
    pub fn n_kv_heads(&self) -> u32 {
        self.shape.n_kv_heads
    }

    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.shape.head_dim
    }

    /// The engine's statistics (`wkv_engine_stats`).
    pub fn stats(&self) -> Result<Stats> {
        let raw = self.live("wkv_engine_stats")?;
        let mut s = Stats::default();
        unsafe { sys::wkv_stats_init(&mut s) };
        check(unsafe { sys::wkv_engine_stats(raw, &mut s) })?;
        Ok(s)
    }

    /// The configuration and statistics as one JSON object
    /// (`wkv_engine_stats_json`).
    pub fn stats_json(&self) -> Result<String> {
        let raw = self.live("wkv_engine_stats_json")?;
        let mut json: *mut c_char = ptr::null_mut();
        check(unsafe { sys::wkv_engine_stats_json(raw, &mut json) })?;
        if json.is_null() {
            return fail(
                Status::Internal,
                "wkv_engine_stats_json: no string returned".to_string(),
            );
        }
        // SAFETY: a NUL-terminated string the library allocated for us,
        // copied, then released with wkv_free.
        let s = unsafe { CStr::from_ptr(json) }
            .to_string_lossy()
            .into_owned();
        unsafe { sys::wkv_free(json as *mut c_void) };
        Ok(s)
    }

    /// Creates an empty sequence (`wkv_seq_create`).
    pub fn create_sequence(&self) -> Result<Sequence> {
        let raw = self.live("wkv_seq_create")?;
        let mut seq: *mut sys::wkv_seq = ptr::null_mut();
        check(unsafe { sys::wkv_seq_create(raw, &mut seq) })?;
        Ok(Sequence {
            raw: seq,
            shape: self.shape,
        })
    }

    /// Loads a sequence from a file that [`Sequence::save`] wrote
    /// (`wkv_seq_load`), as a new sequence of this engine. All or nothing:
    /// after a failure the engine holds nothing of the file. Errors:
    /// [`Status::Corrupt`] for a damaged or truncated file (the message names
    /// the section), [`Status::InvalidArgument`] for a file whose shape or
    /// layout differs from the engine's (the message names each difference)
    /// or a path with a NUL byte, [`Status::Io`] for a file that cannot be
    /// opened or read, [`Status::Unsupported`] for a newer format version.
    pub fn load(&self, path: impl AsRef<Path>) -> Result<Sequence> {
        const F: &str = "wkv_seq_load";
        let raw = self.live(F)?;
        let path = c_path(F, path.as_ref())?;
        let mut seq: *mut sys::wkv_seq = ptr::null_mut();
        // SAFETY: live handle; path is NUL-terminated and outlives the call.
        check(unsafe { sys::wkv_seq_load(raw, path.as_ptr(), &mut seq) })?;
        Ok(Sequence {
            raw: seq,
            shape: self.shape,
        })
    }

    /// Creates a plan, the reusable state of decoding steps
    /// (`wkv_plan_create`).
    pub fn create_plan(&self) -> Result<Plan> {
        let raw = self.live("wkv_plan_create")?;
        let mut plan: *mut sys::wkv_plan = ptr::null_mut();
        check(unsafe { sys::wkv_plan_create(raw, &mut plan) })?;
        Ok(Plan::from_raw(plan, self.shape))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("raw", &self.raw)
            .field("shape", &self.shape)
            .finish()
    }
}

/// One sequence's KV cache (`wkv_seq`). Dropping it, or
/// [`Sequence::close`], destroys the handle.
///
/// `Send` but not `Sync`: wavekv.h requires that each sequence is used by one
/// thread at a time. Appending takes `&mut self`, so it cannot happen while a
/// plan's step ([`crate::Step`]) borrows the sequence.
pub struct Sequence {
    raw: *mut sys::wkv_seq,
    shape: Shape,
}

// SAFETY: the handle may move between threads; without Sync, only one
// thread at a time can reach it.
unsafe impl Send for Sequence {}

impl Sequence {
    pub(crate) fn live(&self, func: &str) -> Result<*mut sys::wkv_seq> {
        if self.raw.is_null() {
            return closed(func, "sequence");
        }
        Ok(self.raw)
    }

    /// Destroys the handle now rather than when dropped. Again is a no-op;
    /// every later call returns [`Status::InvalidHandle`]. A plan that still
    /// refers to the sequence keeps its data alive (wavekv.h).
    pub fn close(&mut self) {
        // SAFETY: raw is a live handle or null, which is a no-op.
        unsafe { sys::wkv_seq_destroy(self.raw) };
        self.raw = ptr::null_mut();
    }

    /// Whether [`Sequence::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.raw.is_null()
    }

    /// Appends tokens' keys and values to one layer (`wkv_seq_append`):
    /// `k` and `v` are packed `[n_tokens][n_kv_heads][head_dim]`, and
    /// n_tokens is their length over `n_kv_heads * head_dim`.
    pub fn append<T: Element>(&mut self, layer: u32, k: &[T], v: &[T]) -> Result<()> {
        const F: &str = "wkv_seq_append";
        let raw = self.live(F)?;
        check_dtype::<T>(F, "k", &self.shape)?;
        let row = self.shape.n_kv_heads as usize * self.shape.head_dim as usize;
        let n = packed_rows(F, "k", k.len(), row, "a token's n_kv_heads x head_dim")?;
        if v.len() != k.len() {
            return fail(
                Status::InvalidArgument,
                format!("{}: v has {} elements, k has {}", F, v.len(), k.len()),
            );
        }
        if n > u32::MAX as u64 {
            return fail(
                Status::InvalidArgument,
                format!("{}: {} tokens in one call", F, n),
            );
        }
        // SAFETY: live handle; k and v hold n tokens, read during the call
        // (a CPU engine; CUDA engines take device pointers through
        // append_raw).
        check(unsafe {
            sys::wkv_seq_append(
                raw,
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                n as u32,
                0,
                0,
                ptr::null_mut(),
            )
        })
    }

    /// Appends `n_tokens` tokens from `[n_tokens][n_kv_heads][head_dim]`
    /// tensors with explicit strides, in elements (`wkv_seq_append`).
    pub fn append_strided<T: Element>(
        &mut self,
        layer: u32,
        k: &[T],
        v: &[T],
        n_tokens: u32,
        strides: Strides,
    ) -> Result<()> {
        const F: &str = "wkv_seq_append";
        let raw = self.live(F)?;
        check_dtype::<T>(F, "k", &self.shape)?;
        let (kv, d) = (self.shape.n_kv_heads as u64, self.shape.head_dim as u64);
        check_span(F, "k", k.len(), n_tokens as u64, kv, d, strides)?;
        check_span(F, "v", v.len(), n_tokens as u64, kv, d, strides)?;
        // SAFETY: as in append; the spans are checked above.
        check(unsafe {
            sys::wkv_seq_append(
                raw,
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                n_tokens,
                strides.outer,
                strides.inner,
                ptr::null_mut(),
            )
        })
    }

    /// `wkv_seq_append` with raw pointers and a stream, for CUDA engines
    /// (device pointers, a `cudaStream_t` or null).
    ///
    /// # Safety
    /// `k` and `v` must point to memory on the engine's device that holds
    /// the tensors the strides describe, valid for the call (and, on CUDA,
    /// until the copy on `stream` completes); `stream` must be null or a
    /// live stream.
    pub unsafe fn append_raw(
        &mut self,
        layer: u32,
        k: *const c_void,
        v: *const c_void,
        n_tokens: u32,
        strides: Strides,
        stream: *mut c_void,
    ) -> Result<()> {
        let raw = self.live("wkv_seq_append")?;
        check(sys::wkv_seq_append(
            raw,
            layer,
            k,
            v,
            n_tokens,
            strides.outer,
            strides.inner,
            stream,
        ))
    }

    /// Appends tokens to one layer of each of several sequences of one
    /// engine in one call (`wkv_append_batch`, ABI 0.5): `k` and `v` are
    /// packed `[seqs.len()][n_tokens][n_kv_heads][head_dim]` (the decoding
    /// layout, new K of shape `[batch][n_kv_heads][head_dim]`, is one token),
    /// and n_tokens is their length over `seqs.len() * n_kv_heads *
    /// head_dim`. Each sequence gets what [`Sequence::append`] would give it.
    ///
    /// The sequences are taken as `&mut`, so none is listed twice and none
    /// is borrowed by a [`crate::Step`] meanwhile. Sequences of two engines
    /// fail with [`Status::InvalidHandle`]. An error found before the copy
    /// appends nothing to any sequence; an error in the growth of sequence i
    /// ([`Status::Budget`], [`Status::OutOfMemory`]; the message names i)
    /// leaves the sequences before i with their new tokens and i and those
    /// after it without (wavekv.h).
    pub fn append_batch<T: Element>(
        seqs: &mut [&mut Sequence],
        layer: u32,
        k: &[T],
        v: &[T],
    ) -> Result<()> {
        const F: &str = "wkv_append_batch";
        let shape = batch_shape(F, seqs)?;
        check_dtype::<T>(F, "k", &shape)?;
        let row = seqs.len() as u64 * shape.n_kv_heads as u64 * shape.head_dim as u64;
        if row > usize::MAX as u64 {
            return fail(
                Status::InvalidArgument,
                format!("{}: {} sequences", F, seqs.len()),
            );
        }
        let n = packed_rows(
            F,
            "k",
            k.len(),
            row as usize,
            "n_seqs x n_kv_heads x head_dim",
        )?;
        if v.len() != k.len() {
            return fail(
                Status::InvalidArgument,
                format!("{}: v has {} elements, k has {}", F, v.len(), k.len()),
            );
        }
        if n > u32::MAX as u64 {
            return fail(
                Status::InvalidArgument,
                format!("{}: {} tokens in one call", F, n),
            );
        }
        // SAFETY: live handles; k and v hold n tokens of every sequence,
        // read during the call (a CPU engine; CUDA engines take device
        // pointers through append_batch_raw).
        unsafe {
            append_batch_call(
                seqs,
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                n as u32,
                0,
                Strides::PACKED,
                ptr::null_mut(),
            )
        }
    }

    /// [`Sequence::append_batch`] of `n_tokens` tokens with explicit strides
    /// in elements: sequence i's `[n_tokens][n_kv_heads][head_dim]` begins
    /// `i * seq_stride` elements into `k` and `v` (0: one after another,
    /// packed; any other value is fine, sequences interleaved by token for
    /// instance), with `strides.outer` between tokens and `strides.inner`
    /// between heads, as in [`Sequence::append_strided`].
    pub fn append_batch_strided<T: Element>(
        seqs: &mut [&mut Sequence],
        layer: u32,
        k: &[T],
        v: &[T],
        n_tokens: u32,
        seq_stride: i64,
        strides: Strides,
    ) -> Result<()> {
        const F: &str = "wkv_append_batch";
        let shape = batch_shape(F, seqs)?;
        check_dtype::<T>(F, "k", &shape)?;
        let (kv, d) = (shape.n_kv_heads as u64, shape.head_dim as u64);
        let n_seqs = seqs.len() as u64;
        check_batch_span(
            F,
            "k",
            k.len(),
            n_seqs,
            n_tokens as u64,
            kv,
            d,
            seq_stride,
            strides,
        )?;
        check_batch_span(
            F,
            "v",
            v.len(),
            n_seqs,
            n_tokens as u64,
            kv,
            d,
            seq_stride,
            strides,
        )?;
        // SAFETY: as in append_batch; the spans are checked above.
        unsafe {
            append_batch_call(
                seqs,
                layer,
                k.as_ptr() as *const c_void,
                v.as_ptr() as *const c_void,
                n_tokens,
                seq_stride,
                strides,
                ptr::null_mut(),
            )
        }
    }

    /// `wkv_append_batch` with raw pointers and a stream, for CUDA engines
    /// (device pointers, a `cudaStream_t` or null): one kernel writes every
    /// sequence's rows.
    ///
    /// # Safety
    /// `k` and `v` must point to memory on the engine's device that holds
    /// the tensors `seq_stride` and the strides describe for every
    /// sequence, valid for the call (and, on CUDA, until the copy on
    /// `stream` completes); `stream` must be null or a live stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn append_batch_raw(
        seqs: &mut [&mut Sequence],
        layer: u32,
        k: *const c_void,
        v: *const c_void,
        n_tokens: u32,
        seq_stride: i64,
        strides: Strides,
        stream: *mut c_void,
    ) -> Result<()> {
        batch_shape("wkv_append_batch", seqs)?;
        append_batch_call(seqs, layer, k, v, n_tokens, seq_stride, strides, stream)
    }

    /// Ends the prompt of one layer now, so that its index is built with the
    /// prefill (`wkv_seq_end_prompt`).
    pub fn end_prompt(&mut self, layer: u32) -> Result<()> {
        let raw = self.live("wkv_seq_end_prompt")?;
        check(unsafe { sys::wkv_seq_end_prompt(raw, layer, ptr::null_mut()) })
    }

    /// `wkv_seq_end_prompt` on a CUDA stream.
    ///
    /// # Safety
    /// `stream` must be null or a live stream of the engine's device.
    pub unsafe fn end_prompt_raw(&mut self, layer: u32, stream: *mut c_void) -> Result<()> {
        let raw = self.live("wkv_seq_end_prompt")?;
        check(sys::wkv_seq_end_prompt(raw, layer, stream))
    }

    /// Saves the sequence to the file at `path` (`wkv_seq_save`), whole or
    /// not at all: it is written under a temporary name in the same
    /// directory, fsynced, renamed over `path`, and the directory fsynced.
    /// `fsync: false` skips the fsyncs (`WKV_SAVE_NO_FSYNC`; tests,
    /// benchmarks): other processes still see the old file or the whole new
    /// one, but after a power loss the new one may be refused as corrupt.
    /// [`Engine::load`] reads it back. Errors: [`Status::Io`] with the
    /// system's words (`path` is then untouched), [`Status::InvalidArgument`]
    /// for a path ending in '/' or holding a NUL byte.
    pub fn save(&self, path: impl AsRef<Path>, fsync: bool) -> Result<()> {
        const F: &str = "wkv_seq_save";
        let raw = self.live(F)?;
        let path = c_path(F, path.as_ref())?;
        let flags = if fsync { 0 } else { sys::WKV_SAVE_NO_FSYNC };
        // SAFETY: live handle, used by this thread only (not Sync); path is
        // NUL-terminated and outlives the call.
        check(unsafe { sys::wkv_seq_save(raw, path.as_ptr(), flags) })
    }

    /// Writes the sequence's pages to the engine's spill file and gives their
    /// host memory back (`wkv_seq_evict`; the engine needs a `spill_dir`).
    /// Its next use, or `restore`, reads them back, checking every checksum.
    pub fn evict(&mut self) -> Result<()> {
        let raw = self.live("wkv_seq_evict")?;
        // SAFETY: live handle, used by this thread only (not Sync).
        check(unsafe { sys::wkv_seq_evict(raw) })
    }

    /// Reads an evicted sequence's pages back (`wkv_seq_restore`); a sequence
    /// in memory is left as it is.
    pub fn restore(&mut self) -> Result<()> {
        let raw = self.live("wkv_seq_restore")?;
        // SAFETY: live handle, used by this thread only (not Sync).
        check(unsafe { sys::wkv_seq_restore(raw) })
    }

    /// What one layer holds (`wkv_seq_info_get`).
    pub fn info(&self, layer: u32) -> Result<SeqInfo> {
        let raw = self.live("wkv_seq_info_get")?;
        let mut info = SeqInfo::default();
        unsafe { sys::wkv_seq_info_init(&mut info) };
        check(unsafe { sys::wkv_seq_info_get(raw, layer, &mut info) })?;
        Ok(info)
    }

    /// The raw handle, for calls this crate does not wrap; null once closed.
    /// It stays owned by the `Sequence`.
    pub fn as_raw(&self) -> *mut sys::wkv_seq {
        self.raw
    }
}

// The shape the tensors of a batch are checked against: its first
// sequence's (the library refuses sequences of two engines before it reads
// k or v). Refuses an empty batch and one too large for the ABI.
fn batch_shape(func: &str, seqs: &[&mut Sequence]) -> Result<Shape> {
    match seqs.first() {
        None => fail(Status::InvalidArgument, format!("{}: n_seqs is 0", func)),
        Some(_) if seqs.len() > u32::MAX as usize => fail(
            Status::InvalidArgument,
            format!("{}: {} sequences", func, seqs.len()),
        ),
        Some(s) => Ok(s.shape),
    }
}

thread_local! {
    // The batch's handles, reused so that steady decoding does not allocate.
    static BATCH: RefCell<Vec<*mut sys::wkv_seq>> = const { RefCell::new(Vec::new()) };
}

// Gathers the handles (every sequence live) and calls wkv_append_batch.
// Pre: batch_shape accepted seqs.
#[allow(clippy::too_many_arguments)]
unsafe fn append_batch_call(
    seqs: &[&mut Sequence],
    layer: u32,
    k: *const c_void,
    v: *const c_void,
    n_tokens: u32,
    seq_stride: i64,
    strides: Strides,
    stream: *mut c_void,
) -> Result<()> {
    const F: &str = "wkv_append_batch";
    BATCH.with(|batch| {
        let mut batch = batch.borrow_mut();
        batch.clear();
        for (i, s) in seqs.iter().enumerate() {
            if s.raw.is_null() {
                return fail(
                    Status::InvalidHandle,
                    format!("{}: sequence {} of the batch is closed", F, i),
                );
            }
            batch.push(s.raw);
        }
        check(sys::wkv_append_batch(
            batch.as_ptr(),
            seqs.len() as u32,
            layer,
            k,
            v,
            n_tokens,
            seq_stride,
            strides.outer,
            strides.inner,
            stream,
        ))
    })
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.close();
    }
}

impl fmt::Debug for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sequence").field("raw", &self.raw).finish()
    }
}
