// Tokenizers in Python, named as in Hugging Face's `tokenizers` (Tokenizer.from_file, encode,
// decode, get_vocab_size, token_to_id, id_to_token): a tokenizer.json, or kuai's byte and GPT-2
// tokenizers (kuai.data.get_tokenizer). Text goes in as str and comes out as str (bytes that are
// not UTF-8, e.g. a character cut between tokens, become U+FFFD there, as the library does).
#include <pybind11/stl.h>

#include "bindings.h"
#include "kuai/data/hf_tokenizer.h"
#include "kuai/data/tokenizer.h"

namespace kuai::python {

namespace {

using release = py::call_guard<py::gil_scoped_release>;

// The tokenizer.json one when it is one; the others have no special tokens to add or skip.
struct PyTokenizer {
  std::shared_ptr<data::Tokenizer> tok;
  const data::HfTokenizer* hf() const { return dynamic_cast<const data::HfTokenizer*>(tok.get()); }

  std::vector<int32_t> encode(const std::string& text, bool add_special) const {
    return hf() ? hf()->encode(text, add_special) : tok->encode(text);
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const {
    return hf() ? hf()->decode(ids, skip_special) : tok->decode(ids);
  }
  const data::HfTokenizer& require_hf(const char* what) const {
    if (!hf()) throw std::invalid_argument(std::string(what) + " needs a tokenizer.json tokenizer");
    return *hf();
  }
};

py::str to_str(const std::string& bytes) {
  PyObject* s =
      PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace");
  if (!s) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

}  // namespace

void bind_tokenizer(py::module_& top) {
  py::module_ d = top.attr("data").cast<py::module_>();  // bind_train made it
  py::class_<PyTokenizer>(d, "Tokenizer")
      .def_static(
          "from_file",
          [](const std::string& path) {
            return PyTokenizer{std::shared_ptr<data::Tokenizer>(data::HfTokenizer::load(path))};
          },
          py::arg("path"), "A Hugging Face tokenizer.json.")
      .def(
          "encode",
          [](const PyTokenizer& t, const std::string& text, bool add_special_tokens) {
            py::gil_scoped_release unlocked;
            return t.encode(text, add_special_tokens);
          },
          py::arg("text"), py::arg("add_special_tokens") = true,
          "Token ids of text (with the post-processor's BOS/EOS unless add_special_tokens=False).")
      .def(
          "encode_batch",
          [](const PyTokenizer& t, const std::vector<std::string>& texts, bool add_special_tokens) {
            py::gil_scoped_release unlocked;
            std::vector<std::vector<int32_t>> out;
            out.reserve(texts.size());
            for (const std::string& text : texts) out.push_back(t.encode(text, add_special_tokens));
            return out;
          },
          py::arg("texts"), py::arg("add_special_tokens") = true)
      .def(
          "decode",
          [](const PyTokenizer& t, const std::vector<int32_t>& ids, bool skip_special_tokens) {
            std::string bytes;
            {
              py::gil_scoped_release unlocked;
              bytes = t.decode(ids, skip_special_tokens);
            }
            return to_str(bytes);
          },
          py::arg("ids"), py::arg("skip_special_tokens") = true)
      .def(
          "decode_bytes",
          [](const PyTokenizer& t, const std::vector<int32_t>& ids, bool skip_special_tokens) {
            return py::bytes(t.decode(ids, skip_special_tokens));
          },
          py::arg("ids"), py::arg("skip_special_tokens") = true,
          "The decoded bytes as they are (decode(encode(x)) == x for any bytes).")
      .def("get_vocab_size", [](const PyTokenizer& t) { return t.tok->vocab_size(); })
      .def("token_to_id",
           [](const PyTokenizer& t, const std::string& token) {
             return t.require_hf("token_to_id").token_to_id(token);
           })
      .def("id_to_token",
           [](const PyTokenizer& t, int32_t id) {
             return to_str(t.require_hf("id_to_token").id_to_token(id));
           })
      .def_property_readonly("name", [](const PyTokenizer& t) { return t.tok->name(); })
      .def("__repr__", [](const PyTokenizer& t) {
        return "Tokenizer(" + t.tok->name() +
               ", vocab_size=" + std::to_string(t.tok->vocab_size()) + ")";
      });
  d.def(
      "get_tokenizer",
      [](const std::string& kind, const std::string& bpe_dir) {
        return PyTokenizer{std::shared_ptr<data::Tokenizer>(data::make_tokenizer(kind, bpe_dir))};
      },
      py::arg("kind"), py::arg("bpe_dir") = std::string(data::kDefaultBpeDir),
      "\"byte\", \"gpt2\" (bpe_dir holds encoder.json and vocab.bpe), or the path of a "
      "tokenizer.json or of a directory holding one.");
}

}  // namespace kuai::python
