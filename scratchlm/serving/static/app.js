// The page's client: asks /info for the model, streams /v1/completions (server-sent events), shows tokens/s.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;

async function showModel() {
  try {
    const info = await (await fetch("/info")).json();
    const millions = (info.parameters / 1e6).toFixed(1);
    $("model").textContent = `${info.model} · ${millions}M parameters · context ${info.context_length} tokens`;
    $("model").dataset.name = info.model;
    $("key-field").hidden = !info.api_key_required;
    // The server refuses more new tokens than the context holds.
    $("max-tokens").max = info.context_length;
    $("max-tokens").value = Math.min(Number($("max-tokens").value), info.context_length);
  } catch (error) {
    $("model").textContent = `could not reach the server: ${error}`;
  }
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function generate(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  $("prompt-echo").textContent = prompt;
  $("completion").textContent = "";
  const headers = { "Content-Type": "application/json" };
  if ($("api-key").value) headers.Authorization = `Bearer ${$("api-key").value}`;
  const body = {
    model: $("model").dataset.name,
    prompt,
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    stream: true,
  };
  if ($("top-k").value) body.top_k = Number($("top-k").value);  // empty: no limit
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  const start = performance.now();
  let tokens = 0, firstToken = null, reason = null;
  try {
    const response = await fetch("/v1/completions", { method: "POST", headers, body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) {
      const error = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(error.error.message);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const item of events) {
        const data = item.replace(/^data: /, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          $("completion").textContent += choice.text;
          if (choice.finish_reason) reason = choice.finish_reason;
          else tokens += 1;  // one event per generated token
          if (firstToken === null) firstToken = performance.now();
        }
        const seconds = (performance.now() - (firstToken ?? start)) / 1000;
        if (tokens > 1) setStatus(`${tokens} tokens · ${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
      }
    }
    const total = (performance.now() - start) / 1000;
    const ending = reason === "stop" ? "end of text" : "token limit";
    setStatus(`${tokens} tokens in ${total.toFixed(2)} s · ${(tokens / total).toFixed(1)} tokens/s · stopped at ${ending}`);
  } catch (error) {
    if (error.name === "AbortError") setStatus(`stopped after ${tokens} tokens`);
    else setStatus(`error: ${error.message}`, true);
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
showModel();
