//! Raw declarations of libwavekv's C ABI, one for one with
//! `include/wavekv/wavekv.h`, which is the manual: read it for what each
//! function does, who owns what and which errors it returns.
//!
//! Written by hand (no bindgen at build time, so that the crate builds offline
//! with no registry crate); `tests/header.rs` compiles the header with the C
//! compiler and checks every declaration, struct layout and constant here
//! against it. The safe API is the `wavekv` crate.
#![allow(non_camel_case_types)]

use std::marker::{PhantomData, PhantomPinned};
use std::os::raw::{c_char, c_void};

// Versions

pub const WKV_VERSION_MAJOR: u32 = 0;
pub const WKV_VERSION_MINOR: u32 = 13;
pub const WKV_VERSION_PATCH: u32 = 0;
/// The version as one number: major * 10000 + minor * 100 + patch.
pub const WKV_VERSION_NUMBER: u32 =
    WKV_VERSION_MAJOR * 10000 + WKV_VERSION_MINOR * 100 + WKV_VERSION_PATCH;

// Status codes (never renumbered or reused)

pub const WKV_OK: i32 = 0;
pub const WKV_ERR_INVALID_ARGUMENT: i32 = 1;
pub const WKV_ERR_INVALID_HANDLE: i32 = 2;
pub const WKV_ERR_OUT_OF_RANGE: i32 = 3;
pub const WKV_ERR_UNSUPPORTED: i32 = 4;
pub const WKV_ERR_BUDGET: i32 = 5;
pub const WKV_ERR_OUT_OF_MEMORY: i32 = 6;
pub const WKV_ERR_DEVICE: i32 = 7;
pub const WKV_ERR_IO: i32 = 8;
pub const WKV_ERR_CORRUPT: i32 = 9;
pub const WKV_ERR_STATE: i32 = 10;
pub const WKV_ERR_INTERNAL: i32 = 11;
pub const WKV_ERR_NO_DEVICE: i32 = 12;

// Configuration

pub const WKV_DTYPE_F32: u32 = 0;
pub const WKV_DTYPE_F16: u32 = 1;
pub const WKV_DTYPE_BF16: u32 = 2;

pub const WKV_DEVICE_CPU: u32 = 0;
pub const WKV_DEVICE_CUDA: u32 = 1;
pub const WKV_DEVICE_AUTO: u32 = 2;

pub const WKV_CONFIG_NO_NUMA: u32 = 1 << 0;
pub const WKV_CONFIG_NO_PINNED: u32 = 1 << 1;
pub const WKV_CONFIG_SPILL_NO_URING: u32 = 1 << 2;
pub const WKV_CONFIG_HOST_META_ROWS: u32 = 1 << 3;
pub const WKV_SPILL_IO_URING: u32 = 1 << 0;
pub const WKV_SPILL_IO_DIRECT: u32 = 1 << 1;

pub const WKV_SAVE_NO_FSYNC: u32 = 1 << 0;
pub const WKV_METHOD_OUTLIERS: u32 = 1 << 0;
pub const WKV_METHOD_ONES: u32 = 1 << 1;
pub const WKV_METHOD_SPREAD: u32 = 1 << 2;
pub const WKV_METHOD_TAIL: u32 = 1 << 3;
pub const WKV_METHOD_PAPER: u32 = 0;
pub const WKV_METHOD_DEFAULT: u32 =
    WKV_METHOD_OUTLIERS | WKV_METHOD_ONES | WKV_METHOD_SPREAD | WKV_METHOD_TAIL;

pub const WKV_PAGE_FORMAT_STORAGE: u32 = 0;
pub const WKV_PAGE_FORMAT_INT8: u32 = 1;
pub const WKV_PAGE_FORMAT_INT8_CENTERED: u32 = 2;

/// Everything an engine is opened with; fill it with `wkv_config_init`.
#[repr(C)]
#[derive(Debug, Copy, Clone, PartialEq)]
pub struct wkv_config {
    pub size: u32,
    pub device: u32,
    pub device_id: i32,
    pub n_layers: u32,
    pub n_q_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: u32,
    pub segment_tokens: u32,
    pub update_segment_tokens: u32,
    pub cluster_tokens: u32,
    pub kmeans_iters: u32,
    pub sink_tokens: u32,
    pub window_tokens: u32,
    pub retrieval_frac: f32,
    pub estimation_frac: f32,
    pub page_bytes: u32,
    pub threads: u32,
    pub flags: u32,
    pub page_format: u32,
    pub host_budget_bytes: u64,
    pub host_chunk_bytes: u64,
    pub device_cache_bytes: u64,
    pub seed: u64,
    pub stats_path: *const c_char,
    pub stats_interval_ms: u32,
    pub method: u32,
    pub reserved1: u32,
    pub spill_dir: *const c_char,
    pub spill_budget_bytes: u64,
}

impl Default for wkv_config {
    /// All zero (a null `stats_path`), as C's `{0}`; `wkv_config_init` sets
    /// the library's defaults.
    fn default() -> wkv_config {
        // SAFETY: plain data, for which all-zero bytes are a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// Statistics of one engine; fill `size` with `wkv_stats_init`.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct wkv_stats {
    pub size: u32,
    pub device: u32,
    pub sequences: u64,
    pub tokens: u64,
    pub segments: u64,
    pub clusters: u64,
    pub host_bytes_reserved: u64,
    pub host_bytes_used: u64,
    pub host_budget_bytes: u64,
    pub page_bytes: u64,
    pub pages_used: u64,
    pub pages_free: u64,
    pub steady_bytes: u64,
    pub meta_bytes: u64,
    pub lookups: u64,
    pub retrieved_clusters: u64,
    pub estimated_clusters: u64,
    pub attended_tokens: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub device_cache_bytes: u64,
    pub kmeans_ns: u64,
    pub cache_admissions: u64,
    pub cache_evictions: u64,
    pub manager_backlog: u64,
    pub pin_fallbacks: u64,
    pub spill_io: u64,
    pub spill_bytes_used: u64,
    pub spill_file_bytes: u64,
    pub spill_budget_bytes: u64,
    pub spill_bytes_written: u64,
    pub spill_bytes_read: u64,
    pub evicted_sequences: u64,
    // 0.4: cold pages.
    pub spill_cold_pages: u64,
    pub spill_pages_written: u64,
    pub spill_pages_read: u64,
    pub spill_estimated: u64,
    pub spill_read_errors: u64,
    pub spill_write_errors: u64,
    // 0.6: the device cache's admissions.
    pub cache_frames_given: u64,
    pub cache_records_dropped: u64,
    // 0.7: index growth off the decoding path.
    pub growths_deferred: u64,
    pub growth_waits: u64,
    // 0.8: decode graphs (CUDA engines; 0 on the CPU).
    pub decode_graphs: u64,
    pub device_bytes_reserved: u64,
    pub device_bytes_used: u64,
    pub meta_device_bytes: u64,
    pub meta_host_rows_reserved: u64,
}

/// What one layer of a sequence holds; fill `size` with `wkv_seq_info_init`.
#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct wkv_seq_info {
    pub size: u32,
    pub generating: u32,
    pub tokens: u64,
    pub clustered: u64,
    pub sink: u64,
    pub tail: u64,
    pub segments: u64,
    pub clusters: u64,
    pub pages: u64,
    // 0.6: the spill tier.
    pub evicted: u32,
    pub reserved: u32,
    pub spilled_pages: u64,
}

/// The plan's execution buffer; fill `size` with `wkv_xbuf_view_init`.
#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct wkv_xbuf_view {
    pub size: u32,
    pub n_runs: u32,
    pub n_tokens: u64,
    pub head_dim: u32,
    pub dtype: u32,
    pub k: *const c_void,
    pub v: *const c_void,
    pub offsets: *const i32,
}

// Opaque handles: never constructed in Rust, only pointed to.

#[repr(C)]
pub struct wkv_engine {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

#[repr(C)]
pub struct wkv_seq {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

#[repr(C)]
pub struct wkv_plan {
    _data: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

extern "C" {
    pub fn wkv_version() -> i32;
    pub fn wkv_version_string() -> *const c_char;

    pub fn wkv_status_name(status: i32) -> *const c_char;
    pub fn wkv_last_error() -> *const c_char;
    pub fn wkv_free(ptr: *mut c_void);

    pub fn wkv_config_init(cfg: *mut wkv_config);

    pub fn wkv_engine_open(cfg: *const wkv_config, out: *mut *mut wkv_engine) -> i32;
    pub fn wkv_engine_close(engine: *mut wkv_engine);
    pub fn wkv_engine_config(engine: *const wkv_engine, cfg: *mut wkv_config) -> i32;
    pub fn wkv_engine_device(engine: *const wkv_engine, device: *mut u32) -> i32;
    pub fn wkv_stats_init(stats: *mut wkv_stats);
    pub fn wkv_engine_stats(engine: *mut wkv_engine, stats: *mut wkv_stats) -> i32;
    pub fn wkv_engine_stats_json(engine: *mut wkv_engine, json: *mut *mut c_char) -> i32;

    pub fn wkv_seq_create(engine: *mut wkv_engine, out: *mut *mut wkv_seq) -> i32;
    pub fn wkv_seq_destroy(seq: *mut wkv_seq);
    pub fn wkv_seq_append(
        seq: *mut wkv_seq,
        layer: u32,
        k: *const c_void,
        v: *const c_void,
        n_tokens: u32,
        token_stride: i64,
        head_stride: i64,
        stream: *mut c_void,
    ) -> i32;
    // 0.5
    pub fn wkv_append_batch(
        seqs: *const *mut wkv_seq,
        n_seqs: u32,
        layer: u32,
        k: *const c_void,
        v: *const c_void,
        n_tokens: u32,
        seq_stride: i64,
        token_stride: i64,
        head_stride: i64,
        stream: *mut c_void,
    ) -> i32;
    pub fn wkv_seq_end_prompt(seq: *mut wkv_seq, layer: u32, stream: *mut c_void) -> i32;
    pub fn wkv_seq_info_init(info: *mut wkv_seq_info);
    pub fn wkv_seq_info_get(seq: *const wkv_seq, layer: u32, info: *mut wkv_seq_info) -> i32;

    pub fn wkv_seq_save(seq: *const wkv_seq, path: *const c_char, flags: u32) -> i32;
    pub fn wkv_seq_evict(seq: *mut wkv_seq) -> i32;
    pub fn wkv_seq_restore(seq: *mut wkv_seq) -> i32;
    pub fn wkv_seq_save_fd(seq: *const wkv_seq, fd: i32, flags: u32) -> i32;
    pub fn wkv_seq_load(
        engine: *mut wkv_engine,
        path: *const c_char,
        out: *mut *mut wkv_seq,
    ) -> i32;
    pub fn wkv_seq_load_fd(engine: *mut wkv_engine, fd: i32, out: *mut *mut wkv_seq) -> i32;

    pub fn wkv_plan_create(engine: *mut wkv_engine, out: *mut *mut wkv_plan) -> i32;
    pub fn wkv_plan_destroy(plan: *mut wkv_plan);
    pub fn wkv_lookup(
        plan: *mut wkv_plan,
        seqs: *const *mut wkv_seq,
        n_seqs: u32,
        layer: u32,
        q: *const c_void,
        seq_stride: i64,
        head_stride: i64,
        stream: *mut c_void,
    ) -> i32;
    pub fn wkv_assemble(plan: *mut wkv_plan, stream: *mut c_void) -> i32;
    pub fn wkv_xbuf_view_init(view: *mut wkv_xbuf_view);
    pub fn wkv_plan_xbuf(plan: *const wkv_plan, view: *mut wkv_xbuf_view) -> i32;
    pub fn wkv_attend(
        plan: *mut wkv_plan,
        out: *mut c_void,
        seq_stride: i64,
        head_stride: i64,
        lse: *mut f32,
        stream: *mut c_void,
    ) -> i32;
    pub fn wkv_merge(
        plan: *mut wkv_plan,
        out: *mut c_void,
        seq_stride: i64,
        head_stride: i64,
        lse: *mut f32,
        lse_seq_stride: i64,
        stream: *mut c_void,
    ) -> i32;
    pub fn wkv_update(plan: *mut wkv_plan, stream: *mut c_void) -> i32;
    pub fn wkv_decode(
        plan: *mut wkv_plan,
        seqs: *const *mut wkv_seq,
        n_seqs: u32,
        layer: u32,
        q: *const c_void,
        q_seq_stride: i64,
        q_head_stride: i64,
        out: *mut c_void,
        out_seq_stride: i64,
        out_head_stride: i64,
        stream: *mut c_void,
    ) -> i32;

    // 0.9: steps a runtime captures (CUDA engines without cold pages).
    pub fn wkv_plan_bind(
        plan: *mut wkv_plan,
        seqs: *const *mut wkv_seq,
        n_seqs: u32,
        max_steps: u32,
        stream: *mut c_void,
    ) -> i32;
    pub fn wkv_plan_prepare(plan: *mut wkv_plan, stream: *mut c_void) -> i32;
    pub fn wkv_plan_unbind(plan: *mut wkv_plan, stream: *mut c_void) -> i32;
}
