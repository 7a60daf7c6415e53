// How ends of operations reach asyncio without the GIL on ferry's loop thread: the operation's
// completion callback (loop thread) appends (key, status, error) to a queue and, when the queue
// was empty, writes the queue's eventfd; the asyncio loop watches that fd (add_reader) and
// drains the queue on its own thread, where it resolves the futures by key. One write per
// batch, no polling, no GIL taken by the loop thread.
#include "completions.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry::python {

EventFd::EventFd() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) {
    throw Error(ErrorCode::Internal, std::string("eventfd failed: ") + std::strerror(errno));
  }
}

EventFd::~EventFd() { ::close(fd_); }

void EventFd::signal() noexcept {
  std::uint64_t one = 1;
  while (::write(fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void EventFd::clear() noexcept {
  std::uint64_t n = 0;
  while (::read(fd_, &n, sizeof n) < 0 && errno == EINTR) {
  }
}

void Completions::Shared::push(Entry e) {
  bool was_empty;
  {
    std::lock_guard lock(mu);
    was_empty = ready.empty();
    ready.push_back(std::move(e));
  }
  if (was_empty) fd.signal();
}

std::vector<Completions::Entry> Completions::Shared::take() {
  fd.clear();
  std::vector<Entry> out;
  std::lock_guard lock(mu);
  out.swap(ready);
  return out;
}

void watch(Completions& queue, Operation& op, std::uint64_t key) {
  std::shared_ptr<Completions::Shared> shared = queue.shared();
  op.on_complete([shared, key](OperationStatus status, const Error* error) {
    Completions::Entry e;
    e.key = key;
    e.status = status;
    if (error != nullptr) e.error = *error;
    shared->push(std::move(e));
  });
}

void Notifier::notify() noexcept {
  if (!pending_.exchange(true, std::memory_order_acq_rel)) fd_.signal();
}

void Notifier::clear() noexcept {
  // The fd first: a notify() between the two finds pending_ still set and does not signal, and
  // its event is in the queue the caller reads next. The other order could drain that notify's
  // signal and leave pending_ set, so that no later notify() signals again.
  fd_.clear();
  pending_.store(false, std::memory_order_release);
}

void bind_completions(py::module_& m) {
  py::class_<Completions>(m, "Completions", R"(Ends of operations, for one asyncio loop.

watch(op, key) registers op's end under key; the loop thread then appends (key, status, error)
and wakes `fd`, which the asyncio loop watches; drain() takes what arrived.)")
      .def(py::init<>())
      .def_property_readonly("fd", &Completions::fd)
      .def("drain", [](Completions& c) {
        std::vector<Completions::Entry> entries = c.shared()->take();
        py::list out(entries.size());
        std::size_t i = 0;
        for (Completions::Entry& e : entries) {
          py::object err = e.error ? error_object(*e.error) : py::none();
          py::object msg = py::none();
          if (e.message) {
            msg = py::make_tuple(e.message->subject, e.message->reply, py::bytes(e.message->data));
          }
          out[i++] =
              py::make_tuple(e.key, static_cast<int>(e.status), std::move(err), std::move(msg));
        }
        return out;
      });
  py::class_<Notifier, std::shared_ptr<Notifier>>(m, "Notifier",
                                                  "An eventfd the loop thread signals once per "
                                                  "batch of events; clear() before draining.")
      .def(py::init<>())
      .def_property_readonly("fd", &Notifier::fd)
      .def("notify", &Notifier::notify)
      .def("clear", &Notifier::clear);
}

}  // namespace ferry::python
