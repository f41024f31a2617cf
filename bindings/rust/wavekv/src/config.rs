use std::mem;
use std::ops::Deref;

use wavekv_sys as sys;

use crate::element::Dtype;

/// Where an engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU backend: host memory, host pointers (`WKV_DEVICE_CPU`).
    Cpu,
    /// A CUDA GPU: device pointers (`WKV_DEVICE_CUDA`).
    Cuda,
    /// CUDA when this build and machine have a GPU, else CPU
    /// (`WKV_DEVICE_AUTO`; only in a [`Config`], never an engine's device).
    Auto,
}

impl Device {
    /// The `WKV_DEVICE_*` value.
    pub fn raw(self) -> u32 {
        match self {
            Device::Cpu => sys::WKV_DEVICE_CPU,
            Device::Cuda => sys::WKV_DEVICE_CUDA,
            Device::Auto => sys::WKV_DEVICE_AUTO,
        }
    }

    /// The device of a `WKV_DEVICE_*` value; `None` for one this binding
    /// does not know.
    pub fn from_raw(raw: u32) -> Option<Device> {
        match raw {
            sys::WKV_DEVICE_CPU => Some(Device::Cpu),
            sys::WKV_DEVICE_CUDA => Some(Device::Cuda),
            sys::WKV_DEVICE_AUTO => Some(Device::Auto),
            _ => None,
        }
    }
}

/// How K and V rows are kept in pages (0.10). Sink and window rows, the
/// execution buffer and every input and output stay in the engine's dtype
/// whatever the pages hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PageFormat {
    /// Rows in the storage dtype, as appended (`WKV_PAGE_FORMAT_STORAGE`).
    Storage,
    /// Rows in 8 bits with one f32 scale each (`WKV_PAGE_FORMAT_INT8`):
    /// about half the bytes of a 16-bit token in host memory, the spill
    /// file and the device cache; attention to a retrieved token is to its
    /// 8-bit row.
    Int8,
    /// As `Int8`, with each key row kept as its difference from its
    /// cluster's centroid rounded to f16 (`WKV_PAGE_FORMAT_INT8_CENTERED`,
    /// libwavekv 0.11): the same bytes, less of the 8-bit
    /// error on keys that share a large offset.
    Int8Centered,
}

impl PageFormat {
    /// The `WKV_PAGE_FORMAT_*` value.
    pub fn raw(self) -> u32 {
        match self {
            PageFormat::Storage => sys::WKV_PAGE_FORMAT_STORAGE,
            PageFormat::Int8 => sys::WKV_PAGE_FORMAT_INT8,
            PageFormat::Int8Centered => sys::WKV_PAGE_FORMAT_INT8_CENTERED,
        }
    }

    /// The format of a `WKV_PAGE_FORMAT_*` value; `None` for one this
    /// binding does not know.
    pub fn from_raw(raw: u32) -> Option<PageFormat> {
        match raw {
            sys::WKV_PAGE_FORMAT_STORAGE => Some(PageFormat::Storage),
            sys::WKV_PAGE_FORMAT_INT8 => Some(PageFormat::Int8),
            sys::WKV_PAGE_FORMAT_INT8_CENTERED => Some(PageFormat::Int8Centered),
            _ => None,
        }
    }
}

/// Everything an engine is opened with: a `wkv_config` filled with the
/// library's defaults (`wkv_config_init`) and the model shape, changed by the
/// builder methods below. The fields read through `Deref`
/// (`config.segment_tokens`); wavekv.h documents each, with its default and
/// bounds, and the environment variables that override them at open time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Config {
    raw: sys::wkv_config,
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, value: $ty) -> Config {
                self.raw.$name = value;
                self
            }
        )*
    };
}

impl Config {
    /// The library's defaults for a model of this shape (head_dim 64, 80,
    /// 96, 128 or 256; n_kv_heads dividing n_q_heads).
    pub fn new(n_layers: u32, n_q_heads: u32, n_kv_heads: u32, head_dim: u32) -> Config {
        // SAFETY: wkv_config is plain data; wkv_config_init fills all of it.
        let mut raw: sys::wkv_config = unsafe { mem::zeroed() };
        unsafe { sys::wkv_config_init(&mut raw) };
        raw.n_layers = n_layers;
        raw.n_q_heads = n_q_heads;
        raw.n_kv_heads = n_kv_heads;
        raw.head_dim = head_dim;
        Config { raw }
    }

    /// A configuration from a raw struct, `size` included, taken as is.
    pub fn from_raw(raw: sys::wkv_config) -> Config {
        Config { raw }
    }

    /// The raw struct, as `wkv_engine_open` reads it.
    pub fn as_raw(&self) -> &sys::wkv_config {
        &self.raw
    }

    /// The raw struct, for fields this binding has no setter for.
    pub fn as_raw_mut(&mut self) -> &mut sys::wkv_config {
        &mut self.raw
    }

    /// Where the engine runs (CPU).
    pub fn device(mut self, device: Device) -> Config {
        self.raw.device = device.raw();
        self
    }

    /// The dtype of K, V, q and outputs (F16).
    pub fn dtype(mut self, dtype: Dtype) -> Config {
        self.raw.dtype = dtype.raw();
        self
    }

    /// How K and V rows are kept in pages (Storage); libwavekv 0.10 on.
    pub fn page_format(mut self, format: PageFormat) -> Config {
        self.raw.page_format = format.raw();
        self
    }

    setters! {
        /// CUDA device ordinal (0).
        device_id: i32;
        /// Prompt tokens clustered together (8192).
        segment_tokens: u32;
        /// Generated tokens clustered together (1024).
        update_segment_tokens: u32;
        /// Mean tokens per cluster (16).
        cluster_tokens: u32;
        /// K-means iterations (10).
        kmeans_iters: u32;
        /// First tokens always attended (4).
        sink_tokens: u32;
        /// Most recent tokens always attended (64).
        window_tokens: u32;
        /// Fraction of clusters attended exactly (0.018).
        retrieval_frac: f32;
        /// Fraction of clusters estimated (0.232).
        estimation_frac: f32;
        /// Bytes of K (and of V) per page (2048).
        page_bytes: u32;
        /// Worker threads; 0 = one per core (0).
        threads: u32;
        /// `WKV_CONFIG_*` bits (0).
        flags: u32;
        /// Cap on host page memory; 0 = unlimited (0).
        host_budget_bytes: u64;
        /// Host arena chunk size (64 MiB).
        host_chunk_bytes: u64;
        /// GPU block cache; 0 = 5% of the device's memory (0).
        device_cache_bytes: u64;
        /// Seed of k-means initialisation (0x5eed).
        seed: u64;
        /// `WKV_METHOD_*` bits (`WKV_METHOD_DEFAULT`).
        method: u32;
        /// Cap on the spill file's bytes; 0 = unlimited (0). The spill
        /// directory itself is given to `Engine::open_with_files` (or, as a
        /// C string kept alive until the engine is open, through
        /// `as_raw_mut`).
        spill_budget_bytes: u64;
    }
}

impl Deref for Config {
    type Target = sys::wkv_config;
    fn deref(&self) -> &sys::wkv_config {
        &self.raw
    }
}
