// The prefill attention's body (attention_block.inc) compiled with -mavx2 -mfma, chosen at run
// time on CPUs that have both (attention.cc).
#define LRJAX_ATTN_BLOCK AttendBlockAvx2
#include "attention_block.inc"
