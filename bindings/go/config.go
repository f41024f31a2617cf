package wavekv

/*
#include <wavekv/wavekv.h>
*/
import "C"

import "fmt"

// Dtype is the engine's storage dtype: the element type of K, V, q and
// outputs.
type Dtype uint32

const (
	DtypeF32  Dtype = C.WKV_DTYPE_F32  // float32; tensors are F32
	DtypeF16  Dtype = C.WKV_DTYPE_F16  // IEEE half; tensors are F16 (the bits)
	DtypeBF16 Dtype = C.WKV_DTYPE_BF16 // bfloat16; tensors are BF16 (the bits)
)

func (d Dtype) String() string {
	switch d {
	case DtypeF32:
		return "f32"
	case DtypeF16:
		return "f16"
	case DtypeBF16:
		return "bf16"
	}
	return fmt.Sprintf("dtype(%d)", uint32(d))
}

// Device is where an engine runs.
type Device uint32

const (
	DeviceCPU  Device = C.WKV_DEVICE_CPU  // host memory and host pointers
	DeviceCUDA Device = C.WKV_DEVICE_CUDA // a CUDA GPU: device pointers
	DeviceAuto Device = C.WKV_DEVICE_AUTO // CUDA when usable, else CPU (a Config only)
)

func (d Device) String() string {
	switch d {
	case DeviceCPU:
		return "cpu"
	case DeviceCUDA:
		return "cuda"
	case DeviceAuto:
		return "auto"
	}
	return fmt.Sprintf("device(%d)", uint32(d))
}

// PageFormat is how K and V rows are kept in pages (0.10). Sink and window
// rows, the execution buffer and every input and output stay in the
// engine's dtype whatever the pages hold.
type PageFormat uint32

const (
	PageFormatStorage PageFormat = C.WKV_PAGE_FORMAT_STORAGE // rows in the storage dtype, as appended
	PageFormatInt8    PageFormat = C.WKV_PAGE_FORMAT_INT8    // 8-bit rows with an f32 scale each
	// The same, keys kept as differences from their clusters' centroids
	// (0.11).
	PageFormatInt8Centered PageFormat = C.WKV_PAGE_FORMAT_INT8_CENTERED
)

func (f PageFormat) String() string {
	switch f {
	case PageFormatStorage:
		return "storage"
	case PageFormatInt8:
		return "int8"
	case PageFormatInt8Centered:
		return "int8-centered"
	}
	return fmt.Sprintf("page_format(%d)", uint32(f))
}

// Bits of Config.Flags.
const (
	ConfigNoNUMA       uint32 = C.WKV_CONFIG_NO_NUMA        // do not bind host arenas to a NUMA node
	ConfigNoPinned     uint32 = C.WKV_CONFIG_NO_PINNED      // pageable host memory for arenas (CUDA)
	ConfigSpillNoURing uint32 = C.WKV_CONFIG_SPILL_NO_URING // the spill file uses pread/pwrite
	ConfigHostMetaRows uint32 = C.WKV_CONFIG_HOST_META_ROWS // the f32 meta rows in pinned host memory (CUDA, 0.12)
	SpillIOURing       uint64 = C.WKV_SPILL_IO_URING        // Stats.SpillIO: io_uring
	SpillIODirect      uint64 = C.WKV_SPILL_IO_DIRECT       // Stats.SpillIO: O_DIRECT
)

// Bits of Config.Method (wavekv.h and docs/accuracy.md say what each does).
const (
	MethodOutliers uint32 = C.WKV_METHOD_OUTLIERS // outlier keys split off as clusters of one
	MethodOnes     uint32 = C.WKV_METHOD_ONES     // clusters of one ranked apart for retrieval
	MethodSpread   uint32 = C.WKV_METHOD_SPREAD   // spread-corrected cluster logits
	MethodTail     uint32 = C.WKV_METHOD_TAIL     // clusters beyond the estimation zone estimated
	MethodPaper    uint32 = C.WKV_METHOD_PAPER    // the paper's method
	MethodDefault  uint32 = C.WKV_METHOD_DEFAULT  // every refinement
)

// Config is everything an engine is opened with (wkv_config). Start from
// DefaultConfig, then set the model shape. wavekv.h documents each field,
// its default and bounds, and the environment variables that override
// fields at open time.
type Config struct {
	Device              Device  // where the engine runs (DeviceCPU)
	DeviceID            int32   // CUDA device ordinal (0)
	NLayers             uint32  // model layers (required)
	NQHeads             uint32  // query heads (required)
	NKVHeads            uint32  // KV heads; must divide NQHeads (required)
	HeadDim             uint32  // 64, 80, 96, 128 or 256 (required)
	Dtype               Dtype   // of K, V, q and outputs (DtypeF16)
	SegmentTokens       uint32  // prompt tokens clustered together (8192)
	UpdateSegmentTokens uint32  // generated tokens clustered together (1024)
	ClusterTokens       uint32  // mean tokens per cluster (16)
	KMeansIters         uint32  // k-means iterations (10)
	SinkTokens          uint32  // first tokens always attended (4)
	WindowTokens        uint32  // most recent tokens always attended (64)
	RetrievalFrac       float32 // fraction of clusters attended exactly (0.018)
	EstimationFrac      float32 // fraction of clusters estimated (0.232)
	PageBytes           uint32  // bytes of K (and of V) per page (2048)
	Threads             uint32  // worker threads; 0 = one per core (0)
	Flags               uint32  // Config* bits (0)
	HostBudgetBytes     uint64  // cap on host page memory; 0 = unlimited (0)
	HostChunkBytes      uint64  // host arena chunk size (64 MiB)
	DeviceCacheBytes    uint64  // GPU block cache; 0 = 5% of the device's memory (0)
	Seed                uint64  // seed of k-means initialisation (0x5eed)
	Method              uint32  // Method* bits (MethodDefault)
	SpillDir            string  // directory of the spill file ("": no spill tier; Sequence.Evict)
	SpillBudgetBytes    uint64  // cap on the spill file's bytes; 0 = unlimited (0)

	// The page format (0.10).
	PageFormat PageFormat // how K and V rows are kept in pages (PageFormatStorage)
}

// DefaultConfig returns the library's defaults (wkv_config_init); the shape
// fields are zero and must be set.
func DefaultConfig() Config {
	var c C.wkv_config
	C.wkv_config_init(&c)
	return configFromC(&c)
}

func configFromC(c *C.wkv_config) Config {
	return Config{
		Device:              Device(c.device),
		DeviceID:            int32(c.device_id),
		NLayers:             uint32(c.n_layers),
		NQHeads:             uint32(c.n_q_heads),
		NKVHeads:            uint32(c.n_kv_heads),
		HeadDim:             uint32(c.head_dim),
		Dtype:               Dtype(c.dtype),
		SegmentTokens:       uint32(c.segment_tokens),
		UpdateSegmentTokens: uint32(c.update_segment_tokens),
		ClusterTokens:       uint32(c.cluster_tokens),
		KMeansIters:         uint32(c.kmeans_iters),
		SinkTokens:          uint32(c.sink_tokens),
		WindowTokens:        uint32(c.window_tokens),
		RetrievalFrac:       float32(c.retrieval_frac),
		EstimationFrac:      float32(c.estimation_frac),
		PageBytes:           uint32(c.page_bytes),
		Threads:             uint32(c.threads),
		Flags:               uint32(c.flags),
		HostBudgetBytes:     uint64(c.host_budget_bytes),
		HostChunkBytes:      uint64(c.host_chunk_bytes),
		DeviceCacheBytes:    uint64(c.device_cache_bytes),
		Seed:                uint64(c.seed),
		Method:              uint32(c.method),
		SpillDir:            goStringOrEmpty(c.spill_dir),
		SpillBudgetBytes:    uint64(c.spill_budget_bytes),
		PageFormat:          PageFormat(c.page_format),
	}
}

func goStringOrEmpty(p *C.char) string {
	if p == nil {
		return ""
	}
	return C.GoString(p)
}

// toC fills a wkv_config from the defaults up: fields a newer header adds
// keep their defaults. SpillDir is left to the caller (a C string it frees).
func (cfg *Config) toC() C.wkv_config {
	var c C.wkv_config
	C.wkv_config_init(&c)
	c.device = C.uint32_t(cfg.Device)
	c.device_id = C.int32_t(cfg.DeviceID)
	c.n_layers = C.uint32_t(cfg.NLayers)
	c.n_q_heads = C.uint32_t(cfg.NQHeads)
	c.n_kv_heads = C.uint32_t(cfg.NKVHeads)
	c.head_dim = C.uint32_t(cfg.HeadDim)
	c.dtype = C.uint32_t(cfg.Dtype)
	c.segment_tokens = C.uint32_t(cfg.SegmentTokens)
	c.update_segment_tokens = C.uint32_t(cfg.UpdateSegmentTokens)
	c.cluster_tokens = C.uint32_t(cfg.ClusterTokens)
	c.kmeans_iters = C.uint32_t(cfg.KMeansIters)
	c.sink_tokens = C.uint32_t(cfg.SinkTokens)
	c.window_tokens = C.uint32_t(cfg.WindowTokens)
	c.retrieval_frac = C.float(cfg.RetrievalFrac)
	c.estimation_frac = C.float(cfg.EstimationFrac)
	c.page_bytes = C.uint32_t(cfg.PageBytes)
	c.threads = C.uint32_t(cfg.Threads)
	c.flags = C.uint32_t(cfg.Flags)
	c.host_budget_bytes = C.uint64_t(cfg.HostBudgetBytes)
	c.host_chunk_bytes = C.uint64_t(cfg.HostChunkBytes)
	c.device_cache_bytes = C.uint64_t(cfg.DeviceCacheBytes)
	c.seed = C.uint64_t(cfg.Seed)
	c.method = C.uint32_t(cfg.Method)
	c.spill_budget_bytes = C.uint64_t(cfg.SpillBudgetBytes)
	c.page_format = C.uint32_t(cfg.PageFormat)
	return c
}

// Stats are an engine's statistics (wkv_stats); counters are totals since
// the engine opened. wavekv.h documents each.
type Stats struct {
	Device            Device
	Sequences         uint64 // live sequences
	Tokens            uint64 // tokens held, summed over sequences and layers
	Segments          uint64 // clustered segments, summed likewise
	Clusters          uint64 // clusters in the meta index, summed likewise
	HostBytesReserved uint64
	HostBytesUsed     uint64
	HostBudgetBytes   uint64
	PageBytes         uint64
	PagesUsed         uint64
	PagesFree         uint64
	SteadyBytes       uint64
	MetaBytes         uint64
	Lookups           uint64 // (sequence, layer) lookups served
	RetrievedClusters uint64
	EstimatedClusters uint64
	AttendedTokens    uint64
	CacheHits         uint64
	CacheMisses       uint64
	DeviceCacheBytes  uint64
	KMeansNs          uint64
	CacheAdmissions   uint64
	CacheEvictions    uint64
	ManagerBacklog    uint64
	PinFallbacks      uint64
	SpillIO           uint64 // SpillIO* bits; 0 without a spill file
	SpillBytesUsed    uint64
	SpillFileBytes    uint64
	SpillBudgetBytes  uint64
	SpillBytesWritten uint64
	SpillBytesRead    uint64
	EvictedSequences  uint64
	// Cold pages (CPU engines with a spill directory and a host budget).
	SpillColdPages    uint64 // pages of live sequences in the spill file
	SpillPagesWritten uint64 // cold pages written out, since open
	SpillPagesRead    uint64 // cold pages read back, since open
	SpillEstimated    uint64 // retrievals estimated because a page was on disk
	SpillReadErrors   uint64
	SpillWriteErrors  uint64

	// The device cache's admissions (CUDA engines; 0 on the CPU).
	CacheFramesGiven    uint64 // free device cache frames steps took from the pool for admissions
	CacheRecordsDropped uint64 // steps with no access record (ring full): nothing admitted
	// Index growth off the decoding path.
	GrowthsDeferred uint64 // generated segments' growths begun and left to commit at their point
	GrowthWaits     uint64 // commits of such growths that waited for their clustering
	// Decode graphs (CUDA engines; 0 on the CPU).
	DecodeGraphs uint64 // decoding steps run as a replay of their plan's CUDA graph
	// Memory by where it lives (CUDA engines; 0 on the CPU).
	DeviceBytesReserved  uint64 // device memory the engine holds: its pool (at its peak), the cache
	DeviceBytesUsed      uint64 // of it, allocated now
	MetaDeviceBytes      uint64 // of MetaBytes, the bytes in device memory
	MetaHostRowsReserved uint64 // pinned host memory of the f32 meta rows' pool (ConfigHostMetaRows)
}

func statsFromC(s *C.wkv_stats) Stats {
	return Stats{
		Device:            Device(s.device),
		Sequences:         uint64(s.sequences),
		Tokens:            uint64(s.tokens),
		Segments:          uint64(s.segments),
		Clusters:          uint64(s.clusters),
		HostBytesReserved: uint64(s.host_bytes_reserved),
		HostBytesUsed:     uint64(s.host_bytes_used),
		HostBudgetBytes:   uint64(s.host_budget_bytes),
		PageBytes:         uint64(s.page_bytes),
		PagesUsed:         uint64(s.pages_used),
		PagesFree:         uint64(s.pages_free),
		SteadyBytes:       uint64(s.steady_bytes),
		MetaBytes:         uint64(s.meta_bytes),
		Lookups:           uint64(s.lookups),
		RetrievedClusters: uint64(s.retrieved_clusters),
		EstimatedClusters: uint64(s.estimated_clusters),
		AttendedTokens:    uint64(s.attended_tokens),
		CacheHits:         uint64(s.cache_hits),
		CacheMisses:       uint64(s.cache_misses),
		DeviceCacheBytes:  uint64(s.device_cache_bytes),
		KMeansNs:          uint64(s.kmeans_ns),
		CacheAdmissions:   uint64(s.cache_admissions),
		CacheEvictions:    uint64(s.cache_evictions),
		ManagerBacklog:    uint64(s.manager_backlog),
		PinFallbacks:      uint64(s.pin_fallbacks),
		SpillIO:           uint64(s.spill_io),
		SpillBytesUsed:    uint64(s.spill_bytes_used),
		SpillFileBytes:    uint64(s.spill_file_bytes),
		SpillBudgetBytes:  uint64(s.spill_budget_bytes),
		SpillBytesWritten: uint64(s.spill_bytes_written),
		SpillBytesRead:    uint64(s.spill_bytes_read),
		EvictedSequences:  uint64(s.evicted_sequences),
		SpillColdPages:    uint64(s.spill_cold_pages),
		SpillPagesWritten: uint64(s.spill_pages_written),
		SpillPagesRead:    uint64(s.spill_pages_read),
		SpillEstimated:    uint64(s.spill_estimated),
		SpillReadErrors:   uint64(s.spill_read_errors),
		SpillWriteErrors:  uint64(s.spill_write_errors),

		CacheFramesGiven:    uint64(s.cache_frames_given),
		CacheRecordsDropped: uint64(s.cache_records_dropped),

		GrowthsDeferred: uint64(s.growths_deferred),
		GrowthWaits:     uint64(s.growth_waits),

		DecodeGraphs: uint64(s.decode_graphs),

		DeviceBytesReserved:  uint64(s.device_bytes_reserved),
		DeviceBytesUsed:      uint64(s.device_bytes_used),
		MetaDeviceBytes:      uint64(s.meta_device_bytes),
		MetaHostRowsReserved: uint64(s.meta_host_rows_reserved),
	}
}

// SeqInfo is what one layer of a sequence holds (wkv_seq_info).
type SeqInfo struct {
	Generating bool   // the layer's prompt has ended
	Tokens     uint64 // tokens appended to this layer
	Clustered  uint64 // tokens in clustered segments
	Sink       uint64 // tokens in the sink
	Tail       uint64 // unclustered recent tokens, attended exactly
	Segments   uint64 // clustered segments, per KV head
	Clusters   uint64 // clusters summed over KV heads
	Pages      uint64 // pages summed over KV heads

	// The spill tier (0.6).
	Evicted      bool   // the sequence is evicted (its pages in the spill file)
	SpilledPages uint64 // pages in the spill file now: all while evicted, else its cold pages
}

func seqInfoFromC(i *C.wkv_seq_info) SeqInfo {
	return SeqInfo{
		Generating: i.generating != 0,
		Tokens:     uint64(i.tokens),
		Clustered:  uint64(i.clustered),
		Sink:       uint64(i.sink),
		Tail:       uint64(i.tail),
		Segments:   uint64(i.segments),
		Clusters:   uint64(i.clusters),
		Pages:      uint64(i.pages),

		Evicted:      i.evicted != 0,
		SpilledPages: uint64(i.spilled_pages),
	}
}
