// Registers the kernels of vLLM 0.34.0's standalone no-Triton CPU model runner (MRV2) as torch.ops._C.*, for
// x86 CPUs without triton-cpu.  Built by scripts/vllm_cpu034.sh together with the sdist's csrc/cpu/block_table.cpp
// and csrc/cpu/input_batch.cpp, which define the functions declared here: vLLM registers them only when it builds
// for a non-x86 CPU (VLLM_STANDALONE_CPU_MRV2), so the x86 wheel has no such ops.  The library is loaded by
// vllm/platforms/cpu.py as patched by scripts/vllm_cpu034_patch.py (torch.ops.load_library after vllm._C).
//
// The op names and schemas are the ones vllm/_cpu_ops.py calls and vLLM's csrc/cpu/torch_bindings.cpp defines for
// that build; the C++ signatures are those of the two .cpp files (a mismatch fails at load: undefined symbol).

#include <optional>

#include <torch/all.h>
#include <torch/library.h>

namespace cpu_utils {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// csrc/cpu/block_table.cpp
void gather_block_table_cpu(const Tensor& block_table, Tensor& output, const Tensor& idx_mapping,
                            const Tensor& num_blocks, int64_t num_reqs_padded);
void compute_slot_mapping_cpu(const Tensor& block_table, Tensor& slot_mapping, const Tensor& idx_mapping,
                              const Tensor& query_start_loc, const Tensor& positions, int64_t block_size,
                              bool mapping_enabled, int64_t pad_slot_id);

// csrc/cpu/input_batch.cpp
void prepare_prefill_inputs_cpu(Tensor& input_ids, Tensor& next_prefill_tokens, const Tensor& idx_mapping,
                                const Tensor& query_start_loc, const Tensor& all_token_ids,
                                const Tensor& prefill_len, const Tensor& num_computed_tokens);
Tensor get_prompt_logprobs_token_ids_cpu(int64_t num_tokens, const Tensor& query_start_loc,
                                         const Tensor& idx_mapping, const Tensor& num_computed_tokens,
                                         const Tensor& all_token_ids);
void prepare_pos_seq_lens_cpu(const Tensor& idx_mapping, const Tensor& query_start_loc,
                              const Tensor& num_computed_tokens, Tensor& pos, Tensor& seq_lens);
void prepare_mrope_positions_cpu(Tensor& positions, const Tensor& prefill_positions, const Tensor& prefill_delta,
                                 const Tensor& idx_mapping, const Tensor& query_start_loc,
                                 const Tensor& prefill_lens, const Tensor& num_computed_tokens);
Tensor combine_sampled_and_draft_tokens_cpu(Tensor& input_ids, const Tensor& idx_mapping,
                                            const Tensor& last_sampled_tokens, const Tensor& query_start_loc,
                                            const Tensor& seq_lens, const Tensor& prefill_len,
                                            const Tensor& draft_tokens, const Tensor& cu_num_logits,
                                            int64_t num_logits, int64_t num_new_sampled_tokens);
void post_update_cpu(const Tensor& idx_mapping, Tensor& num_computed_tokens, Tensor& last_sampled_tokens,
                     const OptTensor& output_bin_counts, const Tensor& sampled_tokens, const Tensor& num_sampled,
                     const Tensor& num_rejected, const OptTensor& query_start_loc, Tensor& all_token_ids,
                     Tensor& total_len);

}  // namespace cpu_utils

// A fragment of vLLM's `_C` library (vllm._C defines the library itself).  Each op is declared by its schema and
// given a CPU kernel: every call passes CPU tensors, and any other device fails loudly in the dispatcher.
TORCH_LIBRARY_FRAGMENT(_C, m) {
  namespace k = cpu_utils;

  m.def("gather_block_table_cpu(Tensor block_table, Tensor(a1!) output, Tensor idx_mapping, Tensor num_blocks, "
        "SymInt num_reqs_padded) -> ()");
  m.impl("gather_block_table_cpu", torch::kCPU, TORCH_FN(k::gather_block_table_cpu));

  m.def("compute_slot_mapping_cpu(Tensor block_table, Tensor(a1!) slot_mapping, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor positions, SymInt block_size, bool mapping_enabled, "
        "SymInt pad_slot_id) -> ()");
  m.impl("compute_slot_mapping_cpu", torch::kCPU, TORCH_FN(k::compute_slot_mapping_cpu));

  m.def("prepare_prefill_inputs_cpu(Tensor(a0!) input_ids, Tensor(a1!) next_prefill_tokens, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor all_token_ids, Tensor prefill_len, Tensor num_computed_tokens) -> ()");
  m.impl("prepare_prefill_inputs_cpu", torch::kCPU, TORCH_FN(k::prepare_prefill_inputs_cpu));

  m.def("get_prompt_logprobs_token_ids_cpu(SymInt num_tokens, Tensor query_start_loc, Tensor idx_mapping, "
        "Tensor num_computed_tokens, Tensor all_token_ids) -> Tensor");
  m.impl("get_prompt_logprobs_token_ids_cpu", torch::kCPU, TORCH_FN(k::get_prompt_logprobs_token_ids_cpu));

  m.def("prepare_pos_seq_lens_cpu(Tensor idx_mapping, Tensor query_start_loc, Tensor num_computed_tokens, "
        "Tensor(a3!) pos, Tensor(a4!) seq_lens) -> ()");
  m.impl("prepare_pos_seq_lens_cpu", torch::kCPU, TORCH_FN(k::prepare_pos_seq_lens_cpu));

  m.def("prepare_mrope_positions_cpu(Tensor(a0!) positions, Tensor prefill_positions, Tensor prefill_delta, "
        "Tensor idx_mapping, Tensor query_start_loc, Tensor prefill_lens, Tensor num_computed_tokens) -> ()");
  m.impl("prepare_mrope_positions_cpu", torch::kCPU, TORCH_FN(k::prepare_mrope_positions_cpu));

  m.def("combine_sampled_and_draft_tokens_cpu(Tensor(a0!) input_ids, Tensor idx_mapping, "
        "Tensor last_sampled_tokens, Tensor query_start_loc, Tensor seq_lens, Tensor prefill_len, "
        "Tensor draft_tokens, Tensor cu_num_logits, SymInt num_logits, SymInt num_new_sampled_tokens) -> Tensor");
  m.impl("combine_sampled_and_draft_tokens_cpu", torch::kCPU, TORCH_FN(k::combine_sampled_and_draft_tokens_cpu));

  m.def("post_update_cpu(Tensor idx_mapping, Tensor(a1!) num_computed_tokens, Tensor(a2!) last_sampled_tokens, "
        "Tensor(a3!)? output_bin_counts, Tensor sampled_tokens, Tensor num_sampled, Tensor num_rejected, "
        "Tensor? query_start_loc, Tensor(a8!) all_token_ids, Tensor(a9!) total_len) -> ()");
  m.impl("post_update_cpu", torch::kCPU, TORCH_FN(k::post_update_cpu));
}
