#pragma once

// The whole public API of ferry.
#include <ferry/connector.hpp>
#include <ferry/descriptor.hpp>
#include <ferry/device.hpp>
#include <ferry/error.hpp>
#include <ferry/log.hpp>
#include <ferry/messaging.hpp>
#include <ferry/operation.hpp>
#include <ferry/operation_status.hpp>
#include <ferry/options.hpp>
#include <ferry/rdma_metadata.hpp>
#include <ferry/region.hpp>
#include <ferry/stats.hpp>
