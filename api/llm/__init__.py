"""The embedded vLLM engine: `ChatEngine` (`chat_engine`: the model's template, tokenizer and
request validation), its start (`startup`), one generation's stream (`generation`), the
generation slots (`slots`), the generations running per tenant for erasure (`tenant_aborts`), and
sampling and tool parsing with vLLM's semantics (`sampling`). vLLM is imported only in this
package, and only when the engine starts or a request arrives."""
