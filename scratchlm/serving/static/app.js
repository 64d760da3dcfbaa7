// The page's client: asks /info for the model; completes a prompt over /v1/completions or, for a chat model,
// holds a conversation over /v1/chat/completions; both streamed (server-sent events), with tokens/s.
"use strict";

const $ = (id) => document.getElementById(id);
let controller = null;
let chatMode = false;
// The conversation so far, as the chat API takes it: the page keeps it, the server is stateless.
let history = [];
let conversation = 0;  // counts the clears: a reply that comes back after one belongs to no conversation

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
    // A chat model opens in chat mode; a base model has no chat API, so no chat mode either.
    $("modes").hidden = !info.chat;
    setMode(Boolean(info.chat));
  } catch (error) {
    $("model").textContent = `could not reach the server: ${error}`;
  }
}

function setMode(chat) {
  if (controller) controller.abort();
  chatMode = chat;
  $("chat").hidden = !chat;
  $("clear").hidden = !chat;
  $("complete").hidden = chat;
  $("output").hidden = chat;
  $("generate").textContent = chat ? "Send" : "Generate";
  $("mode-chat").setAttribute("aria-pressed", String(chat));
  $("mode-complete").setAttribute("aria-pressed", String(!chat));
  setStatus("");
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

// The sampling settings, as both APIs take them.
function settings() {
  const body = {
    model: $("model").dataset.name,
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    stream: true,
  };
  if ($("top-k").value) body.top_k = Number($("top-k").value);  // empty: no limit
  return body;
}

// POST `body` to `path` and call `onChoice` with each streamed choice; throws the server's error message.
async function stream(path, body, onChoice) {
  const headers = { "Content-Type": "application/json" };
  if ($("api-key").value) headers.Authorization = `Bearer ${$("api-key").value}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), signal: controller.signal });
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
      for (const choice of chunk.choices) onChoice(choice);
    }
  }
}

// Runs one streamed request: `send(onPiece)` calls `onPiece(finishReason)` once per generated token (and once
// more with the reason); the status shows tokens/s as they come and how it ended. Returns "done", "stopped"
// (the Stop button) or "failed".
async function run(send, ending) {
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  setStatus("generating…");
  const start = performance.now();
  let tokens = 0, firstToken = null, reason = null;
  const onPiece = (finishReason) => {
    if (finishReason) reason = finishReason;
    else tokens += 1;  // one event per generated token
    if (firstToken === null) firstToken = performance.now();
    const seconds = (performance.now() - (firstToken ?? start)) / 1000;
    if (tokens > 1) setStatus(`${tokens} tokens · ${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
  };
  try {
    await send(onPiece);
    const total = (performance.now() - start) / 1000;
    const stopped = reason === "stop" ? ending : "token limit";
    setStatus(`${tokens} tokens in ${total.toFixed(2)} s · ${(tokens / total).toFixed(1)} tokens/s · stopped at ${stopped}`);
    return "done";
  } catch (error) {
    if (error.name === "AbortError") {
      setStatus(`stopped after ${tokens} tokens`);
      return "stopped";
    }
    setStatus(`error: ${error.message}`, true);
    return "failed";
  } finally {
    $("generate").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

async function complete() {
  const prompt = $("prompt").value;
  $("prompt-echo").textContent = prompt;
  $("completion").textContent = "";
  await run((onPiece) => stream("/v1/completions", { ...settings(), prompt }, (choice) => {
    $("completion").textContent += choice.text;
    onPiece(choice.finish_reason);
  }), "end of text");
}

// One turn of the conversation, as a list item: who speaks, and what.
function addTurn(role, content) {
  const item = document.createElement("li");
  item.className = `turn ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Model";
  const text = document.createElement("div");
  text.className = "content";
  text.textContent = content;
  item.append(who, text);
  $("history").append(item);
  item.scrollIntoView({ block: "nearest" });
  return item;
}

async function chat() {
  const content = $("message").value;
  if (!content.trim()) return;
  const system = $("system").value.trim();
  history.push({ role: "user", content });
  const userTurn = addTurn("user", content);
  const reply = addTurn("assistant", "");
  const replyText = reply.querySelector(".content");
  $("message").value = "";
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history];
  const current = conversation;
  const outcome = await run((onPiece) => stream("/v1/chat/completions", { ...settings(), messages }, (choice) => {
    if (choice.delta.role) return;  // the first event names the speaker: no token yet
    replyText.textContent += choice.delta.content ?? "";
    onPiece(choice.finish_reason);
  }), "end of turn");
  const said = replyText.textContent;
  if (current !== conversation) return;  // cleared meanwhile
  if (outcome === "failed") {
    // Nothing was said: take the turn back and give the message back to edit and resend.
    history.pop();
    userTurn.remove();
    reply.remove();
    $("message").value = content;
  } else if (said) {
    history.push({ role: "assistant", content: said });
  } else {
    // The chat API refuses an empty message, so an empty reply is shown but not sent back.
    reply.classList.add("empty");
    replyText.textContent = "(no reply)";
  }
}

function clearChat() {
  if (controller) controller.abort();
  conversation += 1;
  history = [];
  $("history").replaceChildren();
  setStatus("");
  $("message").focus();
}

$("form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (controller) return;
  if (chatMode) chat();
  else complete();
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", clearChat);
$("mode-chat").addEventListener("click", () => setMode(true));
$("mode-complete").addEventListener("click", () => setMode(false));
showModel();
