// Cache lines the attention item loop wants read ahead, issued by the SIMD bodies a few at a
// time as they consume rows, so that memory streams while they compute.
//
// Issued all at once (a block's rows for every kv head, ~200 lines), the prefetches took the
// fill buffers and the body's own loads waited behind them: decode attention from memory cost
// the plain read's time plus the compute's, with no overlap. Issued one per line consumed, a
// single-thread stream with 8 multiply-adds a line ran at 7.5 ns a line against 11.2 without
// any prefetch and 13.2 with bursts of 16 (6.8 with the data in cache).
#pragma once

#include <cstdint>

// Byte ranges, each a run of whole lines (a token's rows for every kv head sit together, and a
// slot's tokens follow one another, so a pass's rows are usually one range).
struct PrefetchQueue {
  static constexpr int64_t kCapacity = 256;
  struct Range {
    const char* at;
    const char* end;
  };
  Range ranges[kCapacity];
  int64_t current = 0, count = 0;

  void push(const void* begin, int64_t bytes) {
    const char* at = static_cast<const char*>(begin);
    if (count > 0 && ranges[count - 1].end == at)
      ranges[count - 1].end = at + bytes;
    else if (count < kCapacity)
      ranges[count++] = {at, at + bytes};
  }
  // Issues up to `lines` queued lines.
  void issue(int64_t lines) {
    for (; lines > 0 && current < count; --lines) {
      Range& range = ranges[current];
      __builtin_prefetch(range.at);
      range.at += 64;
      if (range.at >= range.end) ++current;
    }
  }
  // Issues what is left and empties the queue.
  void flush() {
    for (; current < count; ++current)
      for (const char* at = ranges[current].at; at < ranges[current].end; at += 64) __builtin_prefetch(at);
    current = count = 0;
  }
};

// The calling thread's queue while it runs attention items (else null: the bodies issue nothing).
// The default TLS model (a __tls_get_addr call per body call): initial-exec saved ~2 of ~66 cycles
// per (token, kv head) with the rows in cache, but takes static TLS that a library loaded by
// dlopen (torch.ops.load_library) may not find.
inline thread_local PrefetchQueue* prefetch_queue = nullptr;

// Issues as many queued lines as `bytes` of rows the body has just read: the queue holds the
// rows a few blocks ahead, so reading and prefetching advance at the same rate.
inline void prefetch_as_read(PrefetchQueue* queue, int64_t bytes) {
  if (queue != nullptr) queue->issue(bytes / 64);
}
