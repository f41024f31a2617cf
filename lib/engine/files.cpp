// Saving and loading sequences: the engine's side of sequence files
// (lib/store/seq_file.hpp holds the format).
#include <new>

#include "lib/engine/engine.hpp"
#include "lib/engine/sequence.hpp"

namespace wkv {

Status Engine::save(Sequence &seq, FileIO &io, int fd, uint32_t flags, const ProgressFn &progress) {
  // 1. An evicted sequence comes back; its own appends and growths, on
  //    whatever streams the caller gave them, end before its memory is
  //    copied out. A bound sequence's host state runs ahead of its rows
  //    (prepared steps): not saved until unbound.
  WKV_RETURN_IF_ERROR(check_unbound(seq, "wkv_seq_save"));
  WKV_RETURN_IF_ERROR(restore(seq));
  BufferManager::wait_idle(seq.tracker());
  // 2. One layer at a time: export on the I/O stream (export_layer waits for
  //    it), write, and the next export reuses the snapshot's memory.
  void *stream = backend_->io_stream();
  const IndexContext ix = index_for(seq);
  SeqFileWriter writer(io, fd, cfg_, cfg_.c.device);
  return writer.write(
      [&](uint32_t l, LayerSnapshot *snap) { return export_layer(ix, seq.layer(l), snap, stream); }, flags,
      progress);
}

Status Engine::save(Sequence &seq, FileIO &io, const std::string &path, uint32_t flags, const ProgressFn &progress) {
  WKV_RETURN_IF_ERROR(check_unbound(seq, "wkv_seq_save"));  // before the file is touched
  // replace_file fsyncs the file and its directory itself.
  return replace_file(io, path, !(flags & kSaveNoFsync),
                      [&](int fd) { return save(seq, io, fd, flags | kSaveNoFsync, progress); });
}

Status Engine::load(FileIO &io, int fd, std::shared_ptr<Sequence> *out, const ProgressFn &progress) {
  // 1. The superblock, and whether the file fits this engine; then every
  //    section header and the trailer, so that a truncated or torn file is
  //    refused before anything is built.
  SeqFileReader reader(io, fd);
  WKV_RETURN_IF_ERROR(reader.read_header());
  WKV_RETURN_IF_ERROR(check_file_shape(reader.header(), cfg_));
  WKV_RETURN_IF_ERROR(reader.read_sections());

  // 2. A new sequence, layer by layer: read and check a layer, import it.
  //    The import is a step of the sequence's tracker, so that a sequence
  //    given up midway frees nothing its copies still write.
  std::shared_ptr<Sequence> seq;
  WKV_RETURN_IF_ERROR(Sequence::create(shared_from_this(), &seq));
  void *stream = backend_->io_stream();
  const IndexContext ix = index();
  const uint64_t epoch = buffers_->begin(seq->tracker());
  Status st = Status::ok();
  {
    LayerSnapshot snap;
    for (uint32_t l = 0; l < cfg_.c.n_layers && st.is_ok(); ++l) {
      st = reader.read_layer(l, &snap);
      if (st.is_ok()) {
        // The shape matched the engine's: what check_snapshot finds is the
        // file disagreeing with itself.
        Status checked = check_snapshot(cfg_, snap);
        if (!checked.is_ok()) st = WKV_ERROR(WKV_ERR_CORRUPT, "layer %u: %s", l, checked.message().c_str());
      }
      if (st.is_ok()) st = import_layer(ix, snap, &seq->layer(l), stream);
      if (st.is_ok() && progress) progress(l + 1, cfg_.c.n_layers);
    }
  }
  // 3. Nothing in flight on the I/O stream when the caller gets the
  //    sequence (or when a failed one is destroyed).
  Status marked = backend_->end_work(seq->tracker(), epoch, stream);
  Status synced = backend_->mem_sync(stream);
  if (st.is_ok()) st = synced.is_ok() ? marked : synced;
  if (!st.is_ok()) return st;
  *out = std::move(seq);
  return Status::ok();
}

Status Engine::load(FileIO &io, const std::string &path, std::shared_ptr<Sequence> *out, const ProgressFn &progress) {
  int fd = -1;
  WKV_RETURN_IF_ERROR(open_to_read(io, path, &fd));
  Status st = load(io, fd, out, progress);
  io.close(fd);
  return st;
}

}  // namespace wkv
