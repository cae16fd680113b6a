// Work of one kernel call split over XLA's intra-op thread pool without ever waiting for a task that
// has not started. XLA:CPU runs independent ops at once, so several kernel calls can hold every pool
// thread, each waiting for help it scheduled behind the others: waiting on scheduled tasks deadlocks
// (seen: a decode loop spinning on both cores). Here the caller and its helpers claim units from a
// shared counter; the caller works until none is left and then waits only for units already taken.
// A helper that starts later finds nothing to claim and touches only the counters, which it owns a
// share of (the caller's buffers may be gone by then).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units, int64_t helpers, const F& fn) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> busy{0};
  };
  auto c = std::make_shared<Counters>();
  const F* work = &fn;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([c, units, work] {
      c->busy.fetch_add(1);
      for (int64_t u = c->next.fetch_add(1); u < units; u = c->next.fetch_add(1)) (*work)(u);
      c->busy.fetch_sub(1);
    });
  }
  for (int64_t u = c->next.fetch_add(1); u < units; u = c->next.fetch_add(1)) fn(u);
  while (c->busy.load() > 0) std::this_thread::yield();
}
