// The cluster mapping table: per cluster, where its tokens are stored and in
// what state. The indirection between logical clusters (what the index
// selects) and physical pages (what the tiers hold).
//
// A cluster's members are stored contiguously, in cluster order, in the
// token slots of its (sequence, layer, KV head)'s page list, starting at slot
// `offset` of page `page` and running over ceil((offset + size) / page_tokens)
// pages. Each segment starts on a fresh page, so pages never mix segments.
#pragma once

#include <cstdint>

#include "lib/common/meta_alloc.hpp"
#include "lib/store/host_arena.hpp"

namespace wkv {

// Where a cluster's pages live.
enum class Tier : uint8_t {
  kHost = 0,     // pinned host arena
  kSpilled = 1,  // spill file (its pages are read back before retrieval)
};

// One cluster's descriptor, 16 bytes:
//
//   0        4        6      7       8        12            16
//   | page   | offset | tier | flags | size   | last_access |
//
// page: index into the head's page list (not a PageId); offset: first token
// slot in that page; last_access: the lookup epoch that last retrieved it.
struct ClusterDesc {
  uint32_t page;
  uint16_t offset;
  Tier tier;
  uint8_t flags;
  uint32_t size;
  uint32_t last_access;
};
static_assert(sizeof(ClusterDesc) == 16, "ClusterDesc is one 16-byte entry");

// A run of tokens clustered together.
struct SegmentDesc {
  uint64_t token_begin;    // first token index of the sequence it covers
  uint32_t tokens;         // tokens in the segment
  uint32_t cluster_begin;  // first cluster id
  uint32_t clusters;       // clusters (empty ones dropped)
  uint32_t page_begin;     // first index into the head's page list
  uint32_t pages;
  uint32_t generated;      // 1 if made of generated tokens
};

using MappingTable = MetaVector<ClusterDesc>;

}  // namespace wkv
