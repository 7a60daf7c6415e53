// The connector, its operations, regions and attachments. Every handle keeps the Python objects
// its memory belongs to (`keep`) until the C++ handle is gone, and the C++ handle goes first:
// its destructor cancels and waits until no transport touches the memory (without the GIL),
// and only then are the buffers let go.
#include <pybind11/stl.h>

#include "completions.hpp"

namespace ferry::python {

namespace {

/// An operation of any kind, with what keeps its memory valid. A call that releases the GIL
/// holds its own reference to the C++ handle, so that release() on another thread cannot free it
/// under the call; release() cancels before it lets go of the buffers.
struct PyOp {
  py::object keep;  // declared first: destroyed after `op`
  std::shared_ptr<Operation> op;
  std::optional<RdmaMetadata> metadata;  // passive operations
  std::string id;
  int kind = 0;

  PyOp(Operation o, py::object k, std::optional<RdmaMetadata> md = std::nullopt)
      : keep(std::move(k)),
        op(std::make_shared<Operation>(std::move(o))),
        metadata(std::move(md)),
        id(op->id()),
        kind(static_cast<int>(op->kind())) {}
  ~PyOp() {
    // Nobody else holds `op` now (a method call holds this object): its destructor cancels
    // and waits for the loop, without the GIL.
    if (!op) return;
    without_gil([&] { op.reset(); });
  }
  std::shared_ptr<Operation> handle() const { return op; }
  // Cancels (when not ended) without the GIL; then no transport touches the memory, and the
  // buffers may go even while another thread's call still holds the ended handle.
  void release() {
    std::shared_ptr<Operation> held = op;
    if (!held) return;
    {
      py::gil_scoped_release unlocked;
      held->cancel();
    }
    op.reset();
    keep = py::none();
    metadata.reset();
  }
};

struct PyRegion {
  py::object keep;
  Region region;
  std::shared_ptr<Notifier> notifier;
  ~PyRegion() { close(); }
  void close() {
    if (!region) return;
    without_gil([&] { region.close(); });
  }
};

struct PyAttachment {
  Attachment attachment;
  ~PyAttachment() { detach(); }
  void detach() {
    if (!attachment) return;
    without_gil([&] { attachment.detach(); });
  }
};

std::vector<std::string> strings(const py::object& list) {
  if (list.is_none()) return {};
  return list.cast<std::vector<std::string>>();
}

RegionAccess access_of(const std::string& s) {
  if (s == "read") return RegionAccess::read;
  if (s == "write") return RegionAccess::write;
  if (s == "read_write") return RegionAccess::read_write;
  throw Error(ErrorCode::InvalidArgument,
              "access is 'read', 'write' or 'read_write', not '" + s + "'");
}

std::vector<RegionRange> ranges_of(const py::iterable& ranges) {
  std::vector<RegionRange> out;
  for (const py::handle& h : ranges) {
    auto t = h.cast<std::pair<std::uint64_t, std::uint64_t>>();
    out.push_back({t.first, t.second});
  }
  return out;
}

py::dict event_dict(const RegionEvent& e) {
  static const char* types[] = {"attached", "transfer", "detached", "ended"};
  py::dict d;
  d["type"] = types[static_cast<int>(e.type)];
  d["attachment"] = e.attachment;
  d["peer"] = e.peer;
  d["peer_id"] = e.peer_id;
  d["method"] = e.method;
  d["kind"] = static_cast<int>(e.kind);
  py::list ranges;
  for (const RegionRange& r : e.ranges) ranges.append(py::make_tuple(r.offset, r.length));
  d["ranges"] = ranges;
  d["blocks"] = e.blocks;
  d["tag"] = e.tag;
  d["status"] = static_cast<int>(e.status);
  d["error"] = e.error ? error_object(*e.error) : py::none();
  return d;
}

std::unique_ptr<PyOp> active(Operation op, py::object keep) {
  return std::make_unique<PyOp>(std::move(op), std::move(keep));
}

}  // namespace

std::shared_ptr<Connector> PyConnector::get() const {
  if (!c) throw Error(ErrorCode::InvalidState, "the connector is closed (close() was called)");
  return c;
}

void PyConnector::close() {
  std::shared_ptr<Connector> gone = std::move(c);
  if (!gone) return;
  without_gil([&] { gone.reset(); });
  for (const auto& weak : wake_on_close) {
    if (auto n = weak.lock()) n->notify();
  }
  wake_on_close.clear();
}

void bind_connector(py::module_& m) {
  py::class_<PyOp>(m, "Operation", "One operation handle (ferry's operation classes hold one).")
      .def_property_readonly(
          "status", [](const PyOp& o) { return o.op ? static_cast<int>(o.op->status()) : 0; })
      .def_property_readonly("kind", [](const PyOp& o) { return o.kind; })
      .def_property_readonly("id", [](const PyOp& o) { return o.id; })
      .def_property_readonly("method",
                             [](const PyOp& o) { return o.op ? o.op->method() : std::string(); })
      .def_property_readonly(
          "peer", [](const PyOp& o) { return o.op ? o.op->peer() : std::optional<PeerIdentity>(); })
      .def_property_readonly("error",
                             [](const PyOp& o) -> py::object {
                               std::optional<Error> e = o.op ? o.op->error() : std::nullopt;
                               return e ? error_object(*e) : py::none();
                             })
      // A view into the handle (kept alive by it), not a copy: metadata() is on the hot path.
      .def(
          "metadata",
          [](const PyOp& o) -> const RdmaMetadata& {
            if (!o.metadata) {
              throw Error(ErrorCode::InvalidState, "only a passive operation has metadata");
            }
            return *o.metadata;
          },
          py::return_value_policy::reference_internal)
      .def(
          "wait",
          [](const PyOp& o, const py::object& timeout) {
            auto t = to_wait(timeout);
            std::shared_ptr<Operation> held = o.handle();
            if (!held) return 0;  // released: uninitialized
            py::gil_scoped_release unlocked;
            return static_cast<int>(held->wait(t));
          },
          py::arg("timeout") = py::none())
      .def("cancel",
           [](PyOp& o) {
             std::shared_ptr<Operation> held = o.handle();
             if (!held) return;
             py::gil_scoped_release unlocked;
             held->cancel();
           })
      .def("release", &PyOp::release)
      .def("watch", [](PyOp& o, Completions& c, std::uint64_t key) {
        if (!o.op) throw Error(ErrorCode::InvalidState, "the operation was released");
        watch(c, *o.op, key);
      });

  py::class_<PyRegion>(m, "Region", "A region handle (ferry.Region holds one).")
      .def("metadata", [](const PyRegion& r) { return r.region.metadata(); })
      .def_property_readonly("id", [](const PyRegion& r) { return r.region.id(); })
      .def_property_readonly("is_open", [](const PyRegion& r) { return r.region.is_open(); })
      .def_property_readonly("error",
                             [](const PyRegion& r) -> py::object {
                               auto e = r.region ? r.region.error() : std::nullopt;
                               return e ? error_object(*e) : py::none();
                             })
      .def_property_readonly("events_dropped",
                             [](const PyRegion& r) { return r.region.events_dropped(); })
      .def_property_readonly("notifier", [](const PyRegion& r) { return r.notifier; })
      .def(
          "next_event",
          [](PyRegion& r, const py::object& timeout) -> py::object {
            // None: until an event comes or the region ends (in hour-long waits: the region's
            // deadline arithmetic takes a finite wait).
            const bool forever = timeout.is_none();
            auto t = forever ? std::chrono::nanoseconds(std::chrono::hours(1)) : to_wait(timeout);
            std::optional<RegionEvent> e;
            {
              py::gil_scoped_release unlocked;
              do {
                e = r.region.next_event(t);
              } while (!e && forever && r.region.is_open());
            }
            if (!e) return py::none();
            return event_dict(*e);
          },
          py::arg("timeout") = py::none())
      .def("peers",
           [](const PyRegion& r) {
             std::vector<RegionPeer> peers;
             {
               py::gil_scoped_release unlocked;
               peers = r.region.peers();
             }
             py::list out;
             for (const RegionPeer& p : peers) {
               py::dict d;
               d["attachment"] = p.attachment;
               d["peer"] = p.peer;
               d["peer_id"] = p.peer_id;
               d["method"] = p.method;
               d["access"] = std::string(to_string(p.access));
               out.append(d);
             }
             return out;
           })
      .def("revoke",
           [](PyRegion& r, const std::string& who) {
             py::gil_scoped_release unlocked;
             return r.region.revoke(who);
           })
      .def("close", &PyRegion::close);

  py::class_<PyAttachment>(m, "Attachment", "An attachment handle (ferry.Attachment holds one).")
      .def("metadata", [](const PyAttachment& a) { return a.attachment.metadata(); })
      .def_property_readonly("state",
                             [](const PyAttachment& a) {
                               static const char* names[] = {"attaching", "attached", "detached"};
                               return names[static_cast<int>(a.attachment.state())];
                             })
      .def_property_readonly("method", [](const PyAttachment& a) { return a.attachment.method(); })
      .def_property_readonly("error",
                             [](const PyAttachment& a) -> py::object {
                               auto e = a.attachment ? a.attachment.error() : std::nullopt;
                               return e ? error_object(*e) : py::none();
                             })
      .def("wait_attached",
           [](const PyAttachment& a) {
             py::gil_scoped_release unlocked;
             a.attachment.wait_attached();
           })
      .def("read",
           [](PyAttachment& a, const py::iterable& ranges, const py::list& descs, py::object keep,
              const py::object& timeout, const std::string& tag) {
             TransferOptions o{to_ms(timeout, "timeout"), tag};
             return active(a.attachment.read(ranges_of(ranges), descriptors_of(descs), o),
                           std::move(keep));
           })
      .def("write",
           [](PyAttachment& a, const py::list& descs, py::object keep, const py::iterable& ranges,
              const py::object& timeout, const std::string& tag) {
             TransferOptions o{to_ms(timeout, "timeout"), tag};
             return active(a.attachment.write(descriptors_of(descs), ranges_of(ranges), o),
                           std::move(keep));
           })
      .def("read_blocks",
           [](PyAttachment& a, const std::vector<std::uint64_t>& blocks, const py::list& descs,
              py::object keep, const py::object& timeout, const std::string& tag) {
             TransferOptions o{to_ms(timeout, "timeout"), tag};
             return active(a.attachment.read_blocks(blocks, descriptors_of(descs), o),
                           std::move(keep));
           })
      .def("write_blocks",
           [](PyAttachment& a, const py::list& descs, py::object keep,
              const std::vector<std::uint64_t>& blocks, const py::object& timeout,
              const std::string& tag) {
             TransferOptions o{to_ms(timeout, "timeout"), tag};
             return active(a.attachment.write_blocks(descriptors_of(descs), blocks, o),
                           std::move(keep));
           })
      .def("detach", &PyAttachment::detach);

  py::class_<PyConnector>(m, "Connector", "The C++ connector (ferry.Connector holds one).")
      .def(py::init([](const std::string& name, const py::object& servers, bool use_nats,
                       const py::object& default_timeout, const py::object& subject_timeout,
                       const py::object& peer_timeout, const py::object& transports,
                       const py::object& endpoint_allow, bool use_environment) {
             ConnectorOptions o;
             o.name = name;
             o.default_timeout = to_ms(default_timeout, "default_timeout");
             o.subject_timeout = to_ms(subject_timeout, "subject_timeout");
             if (!peer_timeout.is_none()) o.peer_timeout = to_ms(peer_timeout, "peer_timeout");
             o.transports = strings(transports);
             o.endpoint_allow = strings(endpoint_allow);
             o.use_environment = use_environment;
             o.nats.servers = strings(servers);
             if (!use_nats) {
               o.nats.servers.clear();
               o.nats.use_environment = false;
             }
             auto out = std::make_unique<PyConnector>();
             py::gil_scoped_release unlocked;
             out->c = std::make_shared<Connector>(std::move(o));
             return out;
           }),
           py::arg("name"), py::arg("servers"), py::arg("use_nats"), py::arg("default_timeout"),
           py::arg("subject_timeout"), py::arg("peer_timeout"), py::arg("transports"),
           py::arg("endpoint_allow"), py::arg("use_environment"))
      .def("close", &PyConnector::close)
      .def_property_readonly("closed", [](const PyConnector& c) { return !c.c; })
      .def_property_readonly("has_side_channel",
                             [](PyConnector& c) { return c.get()->has_side_channel(); })
      .def_property_readonly("identity", [](PyConnector& c) { return c.get()->identity(); })
      .def_property_readonly("side_channel_state",
                             [](PyConnector& c) {
                               SideChannelStatus st = c.get()->side_channel_state();
                               return py::make_tuple(std::string(to_string(st.state)), st.detail);
                             })
      .def("endpoints", [](PyConnector& c) { return c.get()->endpoints(); })
      .def("methods", [](PyConnector& c) { return c.get()->methods(); })
      .def("stats_json", [](PyConnector& c) { return c.get()->stats().to_json(); })
      .def("stats_text", [](PyConnector& c) { return c.get()->stats().to_text(); })
      .def("create_readable",
           [](PyConnector& c, const py::list& descs, py::object keep, const py::object& timeout,
              const std::string& subject) {
             std::shared_ptr<Connector> conn = c.get();
             OperationOptions o{to_ms(timeout, "timeout"), subject};
             std::vector<Descriptor> d = descriptors_of(descs);
             ReadableOperation op;
             {
               py::gil_scoped_release unlocked;
               op = conn->create_readable(std::move(d), std::move(o));
             }
             RdmaMetadata md = op.metadata();
             return std::make_unique<PyOp>(std::move(op), std::move(keep), std::move(md));
           })
      .def("create_writable",
           [](PyConnector& c, const py::list& descs, py::object keep, const py::object& timeout,
              const std::string& subject) {
             std::shared_ptr<Connector> conn = c.get();
             OperationOptions o{to_ms(timeout, "timeout"), subject};
             std::vector<Descriptor> d = descriptors_of(descs);
             WritableOperation op;
             {
               py::gil_scoped_release unlocked;
               op = conn->create_writable(std::move(d), std::move(o));
             }
             RdmaMetadata md = op.metadata();
             return std::make_unique<PyOp>(std::move(op), std::move(keep), std::move(md));
           })
      .def("begin_read",
           [](PyConnector& c, const RdmaMetadata& remote, const py::list& descs, py::object keep,
              const py::object& timeout) {
             OperationOptions o{to_ms(timeout, "timeout"), {}};
             return active(c.get()->begin_read(remote, descriptors_of(descs), std::move(o)),
                           std::move(keep));
           })
      .def("begin_write",
           [](PyConnector& c, const py::list& descs, py::object keep, const RdmaMetadata& remote,
              const py::object& timeout) {
             OperationOptions o{to_ms(timeout, "timeout"), {}};
             return active(c.get()->begin_write(descriptors_of(descs), remote, std::move(o)),
                           std::move(keep));
           })
      .def("begin_read_subject",
           [](PyConnector& c, const std::string& subject, const py::list& descs, py::object keep,
              const py::object& timeout) {
             OperationOptions o{to_ms(timeout, "timeout"), {}};
             return active(
                 c.get()->begin_read(Subject(subject), descriptors_of(descs), std::move(o)),
                 std::move(keep));
           })
      .def("begin_write_subject",
           [](PyConnector& c, const py::list& descs, py::object keep, const std::string& subject,
              const py::object& timeout) {
             OperationOptions o{to_ms(timeout, "timeout"), {}};
             return active(
                 c.get()->begin_write(descriptors_of(descs), Subject(subject), std::move(o)),
                 std::move(keep));
           })
      .def("create_region",
           [](PyConnector& c, const py::list& descs, py::object keep, const std::string& access,
              std::uint64_t block_size, const std::string& subject, const py::object& timeout,
              std::size_t max_queued_events) {
             std::shared_ptr<Connector> conn = c.get();
             auto notifier = std::make_shared<Notifier>();
             RegionOptions o;
             o.access = access_of(access);
             o.block_size = block_size;
             o.subject = subject;
             o.timeout = to_ms(timeout, "timeout");
             o.on_event = [notifier](const RegionEvent&) { notifier->notify(); };
             o.max_queued_events = max_queued_events;
             std::vector<Descriptor> d = descriptors_of(descs);
             auto out = std::make_unique<PyRegion>();
             out->keep = std::move(keep);
             out->notifier = notifier;
             py::gil_scoped_release unlocked;
             out->region = conn->create_region(std::move(d), std::move(o));
             return out;
           })
      .def("attach",
           [](PyConnector& c, const RegionMetadata& remote, const py::object& access,
              const py::object& timeout) {
             AttachOptions o;
             if (!access.is_none()) o.access = access_of(access.cast<std::string>());
             o.timeout = to_ms(timeout, "timeout");
             auto out = std::make_unique<PyAttachment>();
             out->attachment = c.get()->attach(remote, o);
             return out;
           })
      .def("attach_subject", [](PyConnector& c, const std::string& subject,
                                const py::object& access, const py::object& timeout) {
        AttachOptions o;
        if (!access.is_none()) o.access = access_of(access.cast<std::string>());
        o.timeout = to_ms(timeout, "timeout");
        auto out = std::make_unique<PyAttachment>();
        out->attachment = c.get()->attach(Subject(subject), o);
        return out;
      });
}

}  // namespace ferry::python
