// Messaging on the connector's NATS connection, for Python: publish and respond as calls;
// subscriptions whose messages the loop thread queues (bounded) and announces through an
// eventfd, and requests whose replies arrive in an asyncio loop's Completions queue.
#include <pybind11/stl.h>

#include <algorithm>
#include <deque>

#include "completions.hpp"

namespace ferry::python {

namespace {

/// The messages of one subscription, from the loop thread to Python.
struct Inbox {
  std::mutex mu;
  std::deque<Message> messages;
  std::size_t max_pending = 65536;
  std::uint64_t dropped = 0;
  std::shared_ptr<Notifier> notifier = std::make_shared<Notifier>();

  void push(const Message& m) {
    {
      std::lock_guard lock(mu);
      messages.push_back(m);
      while (messages.size() > std::max<std::size_t>(max_pending, 1)) {
        messages.pop_front();
        ++dropped;
      }
    }
    notifier->notify();
  }
};

struct PySubscription {
  Subscription sub;
  std::shared_ptr<Inbox> inbox;
  ~PySubscription() { unsubscribe(); }
  void unsubscribe() {
    if (!sub) return;
    without_gil([&] { sub.unsubscribe(); });
    inbox->notifier->notify();  // a waiting iterator sees the end
  }
};

py::tuple as_tuple(const Message& m) {
  return py::make_tuple(m.subject, m.reply, py::bytes(m.data));
}

std::chrono::milliseconds request_timeout(const py::object& timeout) {
  auto t = to_ms(timeout, "timeout");
  if (t.count() <= 0) {
    throw Error(ErrorCode::InvalidArgument, "a request needs a timeout > 0 seconds");
  }
  return t;
}

}  // namespace

void bind_messaging(py::module_& m) {
  py::class_<PySubscription>(m, "Subscription",
                             "A subscription handle (ferry.Subscription holds one).")
      .def_property_readonly("subject", [](const PySubscription& s) { return s.sub.subject(); })
      .def_property_readonly("queue", [](const PySubscription& s) { return s.sub.queue(); })
      .def_property_readonly("active", [](const PySubscription& s) { return s.sub.active(); })
      .def_property_readonly("error",
                             [](const PySubscription& s) -> py::object {
                               auto e = s.sub ? s.sub.error() : std::nullopt;
                               return e ? error_object(*e) : py::none();
                             })
      .def_property_readonly("notifier_fd",
                             [](const PySubscription& s) { return s.inbox->notifier->fd(); })
      .def("clear", [](PySubscription& s) { s.inbox->notifier->clear(); })
      .def_property_readonly("dropped",
                             [](const PySubscription& s) {
                               std::lock_guard lock(s.inbox->mu);
                               return s.inbox->dropped;
                             })
      .def("take",
           [](PySubscription& s, std::size_t most) {
             std::vector<Message> got;
             {
               std::lock_guard lock(s.inbox->mu);
               while (!s.inbox->messages.empty() && got.size() < most) {
                 got.push_back(std::move(s.inbox->messages.front()));
                 s.inbox->messages.pop_front();
               }
             }
             py::list out;
             for (const Message& msg : got) out.append(as_tuple(msg));
             return out;
           })
      .def("unsubscribe", &PySubscription::unsubscribe);

  m.def("subscribe",
        [](PyConnector& c, std::string subject, const std::string& queue, std::size_t max_pending) {
          std::shared_ptr<Connector> conn = c.get();
          auto out = std::make_unique<PySubscription>();
          out->inbox = std::make_shared<Inbox>();
          out->inbox->max_pending = max_pending;
          std::shared_ptr<Inbox> inbox = out->inbox;
          auto& hooks = c.wake_on_close;  // close() wakes a waiting iterator
          hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                                     [](const std::weak_ptr<Notifier>& w) { return w.expired(); }),
                      hooks.end());
          hooks.push_back(inbox->notifier);
          SubscribeOptions o{queue};
          py::gil_scoped_release unlocked;
          out->sub = conn->subscribe(
              std::move(subject), [inbox](const Message& msg) { inbox->push(msg); }, std::move(o));
          return out;
        });
  m.def("publish", [](PyConnector& c, std::string_view subject, std::string_view data,
                      std::string_view reply) {
    std::shared_ptr<Connector> conn = c.get();
    py::gil_scoped_release unlocked;
    conn->publish(subject, data, reply);
  });
  m.def("respond",
        [](PyConnector& c, std::string subject, std::string reply, std::string_view data) {
          std::shared_ptr<Connector> conn = c.get();
          Message request{std::move(subject), std::move(reply), {}};
          py::gil_scoped_release unlocked;
          conn->respond(request, data);
        });
  m.def("request_blocking",
        [](PyConnector& c, std::string subject, std::string data, const py::object& timeout) {
          std::shared_ptr<Connector> conn = c.get();
          auto t = request_timeout(timeout);
          Message reply;
          {
            py::gil_scoped_release unlocked;
            reply = conn->request(std::move(subject), std::move(data), t);
          }
          return as_tuple(reply);
        });
  m.def("request_async", [](PyConnector& c, std::string subject, std::string data,
                            const py::object& timeout, Completions& queue, std::uint64_t key) {
    std::shared_ptr<Connector> conn = c.get();
    auto t = request_timeout(timeout);
    std::shared_ptr<Completions::Shared> shared = queue.shared();
    py::gil_scoped_release unlocked;  // it waits for the loop
    conn->request(std::move(subject), std::move(data), t,
                  [shared, key](const Message* reply, const Error* error) {
                    Completions::Entry e;
                    e.key = key;
                    if (reply != nullptr) {
                      e.message = *reply;
                    } else {
                      e.status = OperationStatus::errored;
                      if (error != nullptr) e.error = *error;
                    }
                    shared->push(std::move(e));
                  });
  });
}

}  // namespace ferry::python
