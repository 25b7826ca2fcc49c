// XLA FFI handlers of the "cpu" backend (platform "cpu"): thin wrappers that check buffer shapes and call CpuComm.
#pragma once
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxMoeCpuDispatchSend(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JaxMoeCpuDispatchRecv(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JaxMoeCpuCombineSend(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JaxMoeCpuCombineRecv(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* JaxMoeCpuTimestamp(XLA_FFI_CallFrame* frame);  // cpu_timestamp.cc, for the benchmark
}
