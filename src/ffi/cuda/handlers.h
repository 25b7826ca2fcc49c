// The CUDA XLA FFI handlers (registered for platform "CUDA" from jax_moe/backends/cuda.py).
#pragma once
#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxMoeCudaDispatchSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaDispatchRecv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombineSend(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombineRecv(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaTimestamp(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaDispatchGraph(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombineGraph(XLA_FFI_CallFrame* call_frame);
// The same, marked command-buffer compatible (see handlers.cc).
XLA_FFI_Error* JaxMoeCudaDispatchSendGraph(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaDispatchRecvGraph(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombineSendGraph(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaCombineRecvGraph(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxMoeCudaTimestampGraph(XLA_FFI_CallFrame* call_frame);
}
