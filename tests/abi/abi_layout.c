/*
 * Prints the layout of the public header's structs and the values of its
 * constants, one fact a line: the abi_layout test compares the output with
 * capi/abi_layout.txt, so that no struct, field or value changes unnoticed
 * (a change needs the file updated in the same commit: `cmake --build BUILD
 * --target abi-update`). Compiled as C99.
 */
#include <stddef.h>
#include <stdio.h>

#include "wavekv/wavekv.h"

#define STRUCT(T) printf("struct %s size %zu align %zu\n", #T, sizeof(T), (size_t)_Alignof(T))
#define FIELD(T, f) printf("  %s.%s offset %zu size %zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f))
#define VALUE(v) printf("value %s %lld\n", #v, (long long)(v))

int main(void) {
  STRUCT(wkv_config);
  FIELD(wkv_config, size);
  FIELD(wkv_config, device);
  FIELD(wkv_config, device_id);
  FIELD(wkv_config, n_layers);
  FIELD(wkv_config, n_q_heads);
  FIELD(wkv_config, n_kv_heads);
  FIELD(wkv_config, head_dim);
  FIELD(wkv_config, dtype);
  FIELD(wkv_config, segment_tokens);
  FIELD(wkv_config, update_segment_tokens);
  FIELD(wkv_config, cluster_tokens);
  FIELD(wkv_config, kmeans_iters);
  FIELD(wkv_config, sink_tokens);
  FIELD(wkv_config, window_tokens);
  FIELD(wkv_config, retrieval_frac);
  FIELD(wkv_config, estimation_frac);
  FIELD(wkv_config, page_bytes);
  FIELD(wkv_config, threads);
  FIELD(wkv_config, flags);
  FIELD(wkv_config, page_format);
  FIELD(wkv_config, host_budget_bytes);
  FIELD(wkv_config, host_chunk_bytes);
  FIELD(wkv_config, device_cache_bytes);
  FIELD(wkv_config, seed);
  FIELD(wkv_config, stats_path);
  FIELD(wkv_config, stats_interval_ms);
  FIELD(wkv_config, method);
  FIELD(wkv_config, reserved1);
  FIELD(wkv_config, spill_dir);
  FIELD(wkv_config, spill_budget_bytes);

  STRUCT(wkv_stats);
  FIELD(wkv_stats, size);
  FIELD(wkv_stats, device);
  FIELD(wkv_stats, sequences);
  FIELD(wkv_stats, tokens);
  FIELD(wkv_stats, segments);
  FIELD(wkv_stats, clusters);
  FIELD(wkv_stats, host_bytes_reserved);
  FIELD(wkv_stats, host_bytes_used);
  FIELD(wkv_stats, host_budget_bytes);
  FIELD(wkv_stats, page_bytes);
  FIELD(wkv_stats, pages_used);
  FIELD(wkv_stats, pages_free);
  FIELD(wkv_stats, steady_bytes);
  FIELD(wkv_stats, meta_bytes);
  FIELD(wkv_stats, lookups);
  FIELD(wkv_stats, retrieved_clusters);
  FIELD(wkv_stats, estimated_clusters);
  FIELD(wkv_stats, attended_tokens);
  FIELD(wkv_stats, cache_hits);
  FIELD(wkv_stats, cache_misses);
  FIELD(wkv_stats, device_cache_bytes);
  FIELD(wkv_stats, kmeans_ns);
  FIELD(wkv_stats, cache_admissions);
  FIELD(wkv_stats, cache_evictions);
  FIELD(wkv_stats, manager_backlog);
  FIELD(wkv_stats, pin_fallbacks);
  FIELD(wkv_stats, spill_io);
  FIELD(wkv_stats, spill_bytes_used);
  FIELD(wkv_stats, spill_file_bytes);
  FIELD(wkv_stats, spill_budget_bytes);
  FIELD(wkv_stats, spill_bytes_written);
  FIELD(wkv_stats, spill_bytes_read);
  FIELD(wkv_stats, evicted_sequences);
  FIELD(wkv_stats, spill_cold_pages);
  FIELD(wkv_stats, spill_pages_written);
  FIELD(wkv_stats, spill_pages_read);
  FIELD(wkv_stats, spill_estimated);
  FIELD(wkv_stats, spill_read_errors);
  FIELD(wkv_stats, spill_write_errors);
  FIELD(wkv_stats, cache_frames_given);
  FIELD(wkv_stats, cache_records_dropped);
  FIELD(wkv_stats, growths_deferred);
  FIELD(wkv_stats, growth_waits);
  FIELD(wkv_stats, decode_graphs);
  FIELD(wkv_stats, device_bytes_reserved);
  FIELD(wkv_stats, device_bytes_used);
  FIELD(wkv_stats, meta_device_bytes);
  FIELD(wkv_stats, meta_host_rows_reserved);

  STRUCT(wkv_seq_info);
  FIELD(wkv_seq_info, size);
  FIELD(wkv_seq_info, generating);
  FIELD(wkv_seq_info, tokens);
  FIELD(wkv_seq_info, clustered);
  FIELD(wkv_seq_info, sink);
  FIELD(wkv_seq_info, tail);
  FIELD(wkv_seq_info, segments);
  FIELD(wkv_seq_info, clusters);
  FIELD(wkv_seq_info, pages);
  FIELD(wkv_seq_info, evicted);
  FIELD(wkv_seq_info, reserved);
  FIELD(wkv_seq_info, spilled_pages);

  STRUCT(wkv_xbuf_view);
  FIELD(wkv_xbuf_view, size);
  FIELD(wkv_xbuf_view, n_runs);
  FIELD(wkv_xbuf_view, n_tokens);
  FIELD(wkv_xbuf_view, head_dim);
  FIELD(wkv_xbuf_view, dtype);
  FIELD(wkv_xbuf_view, k);
  FIELD(wkv_xbuf_view, v);
  FIELD(wkv_xbuf_view, offsets);

  VALUE(WKV_VERSION_MAJOR);
  VALUE(WKV_VERSION_MINOR);
  VALUE(WKV_OK);
  VALUE(WKV_ERR_INVALID_ARGUMENT);
  VALUE(WKV_ERR_INVALID_HANDLE);
  VALUE(WKV_ERR_OUT_OF_RANGE);
  VALUE(WKV_ERR_UNSUPPORTED);
  VALUE(WKV_ERR_BUDGET);
  VALUE(WKV_ERR_OUT_OF_MEMORY);
  VALUE(WKV_ERR_DEVICE);
  VALUE(WKV_ERR_IO);
  VALUE(WKV_ERR_CORRUPT);
  VALUE(WKV_ERR_STATE);
  VALUE(WKV_ERR_INTERNAL);
  VALUE(WKV_ERR_NO_DEVICE);
  VALUE(WKV_DTYPE_F32);
  VALUE(WKV_DTYPE_F16);
  VALUE(WKV_DTYPE_BF16);
  VALUE(WKV_DEVICE_CPU);
  VALUE(WKV_DEVICE_CUDA);
  VALUE(WKV_DEVICE_AUTO);
  VALUE(WKV_CONFIG_NO_NUMA);
  VALUE(WKV_CONFIG_NO_PINNED);
  VALUE(WKV_CONFIG_SPILL_NO_URING);
  VALUE(WKV_CONFIG_HOST_META_ROWS);
  VALUE(WKV_SPILL_IO_URING);
  VALUE(WKV_SPILL_IO_DIRECT);
  VALUE(WKV_SAVE_NO_FSYNC);
  VALUE(WKV_PAGE_FORMAT_STORAGE);
  VALUE(WKV_PAGE_FORMAT_INT8);
  VALUE(WKV_PAGE_FORMAT_INT8_CENTERED);
  return 0;
}
