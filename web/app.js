// Voice chat page for the native websocket protocol (PROTOCOL.md). No build step, no dependencies.
//
// Microphone -> AudioWorklet (mic-worklet.js: 16 kHz PCM16, 20 ms frames) -> /ws;
// reply PCM16 from /ws -> AudioBufferSourceNodes scheduled back to back on the context's clock.
"use strict";

(() => {
  const IN_RATE = 16000;
  const OUT_RATES = [8000, 16000, 22050, 24000, 32000, 44100, 48000]; // what the server accepts
  const LEAD_S = 0.12; // jitter buffer: how far ahead playback (re)starts after the queue ran dry
  const MAX_BUFFERED_BYTES = 64000; // ~2 s of 16 kHz PCM16 stuck in the socket: drop mic frames
  const HISTORY_TURNS = 12;
  // stage -> the mark (ms since end of user speech, from latency.marks_ms) where it starts
  const STAGES = [
    ["endpoint", "speech_end"],
    ["asr", "eos_detected"],
    ["lm_first_block", "final_transcript"],
    ["tts_first_audio", "lm_first_block"],
    ["send", "tts_first_audio"],
  ];
  const EVENTS = new Set(["ready", "speech_started", "speech_stopped", "transcript", "reply", "reply_done",
    "clear", "latency", "error"]);
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const ui = {
    toggle: $("toggle"), conn: $("conn"), activity: $("activity"), error: $("error"), messages: $("messages"),
    partial: $("partial"), hint: $("hint"), waterfall: $("waterfall"), history: $("history"), v2v: $("v2v"),
  };

  // Counters for tests and curious users (window.voiceTest in the console).
  const stats = window.voiceTest = {
    state: "idle", sessionId: null, outputRate: null, events: {},
    framesSent: 0, bytesSent: 0, framesDropped: 0,
    framesReceived: 0, bytesReceived: 0,
    audioFramesScheduled: 0, audioFramesPlayed: 0, bytesPlayed: 0, underruns: 0, clears: 0,
    waterfallBars: 0, latencies: [], errors: [], transcripts: [], replies: [],
  };

  let ws = null, ctx = null, mic = null, micNode = null, micSink = null;
  let running = false, connected = false;
  let outRate = 24000, playhead = 0;
  const sources = new Set();
  const turns = new Map(); // turn -> {user, bot, eosAt, firstAudioAt, playoutMs}
  let audioTurn = 0; // the turn whose reply audio is arriving
  const history = []; // [{turn, v2v, over}]

  // --- ui helpers -----------------------------------------------------------------------------

  function setConn(state, text) {
    stats.state = state;
    ui.conn.dataset.state = state;
    ui.conn.textContent = text;
  }

  let speech = false, thinking = false;
  function updateActivity() {
    let a = "idle";
    if (connected) a = speech ? "hearing you" : sources.size ? "speaking" : thinking ? "thinking" : "listening";
    ui.activity.textContent = a;
    ui.activity.dataset.activity = a;
  }

  function showError(message) {
    stats.errors.push(message);
    ui.error.textContent = message;
    ui.error.hidden = false;
    console.warn(message);
  }

  function clearError() {
    ui.error.hidden = true;
    ui.error.textContent = "";
  }

  function turnState(turn) {
    if (!turns.has(turn)) turns.set(turn, {user: null, bot: null, eosAt: null, firstAudioAt: null, playoutMs: null});
    return turns.get(turn);
  }

  function addMessage(who, text) {
    const li = document.createElement("li");
    li.className = who;
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = who === "user" ? "you" : who === "bot" ? "assistant" : "";
    const body = document.createElement("span");
    body.className = "text";
    body.textContent = text;
    li.append(label, body);
    ui.messages.append(li);
    ui.hint.hidden = true;
    li.scrollIntoView({block: "end"});
    return li;
  }

  // --- start / stop ---------------------------------------------------------------------------

  function serverUrl() {
    const override = new URLSearchParams(location.search).get("ws");
    if (override) return override;
    if (!location.host) return "ws://127.0.0.1:8000/ws"; // opened from a file
    return `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/ws`;
  }

  function micErrorMessage(err) {
    switch (err && err.name) {
      case "NotAllowedError":
      case "SecurityError":
        return "Microphone access was denied. Allow the microphone for this page (site settings) " +
          "and press Start again.";
      case "NotFoundError":
      case "OverconstrainedError":
        return "No microphone was found. Plug one in and press Start again.";
      case "NotReadableError":
        return "The microphone could not be opened (is another application using it?).";
      default:
        return `Could not start the microphone: ${err && err.message ? err.message : err}`;
    }
  }

  async function start() {
    clearError();
    running = true;
    ui.toggle.textContent = "Stop conversation";
    setConn("connecting", "starting microphone…");
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      stop();
      showError("This page cannot use the microphone here: browsers only allow it on https:// or http://localhost.");
      return;
    }
    try {
      mic = await navigator.mediaDevices.getUserMedia({
        audio: {channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true},
      });
    } catch (err) {
      stop();
      showError(micErrorMessage(err));
      return;
    }
    if (!running) return stop();
    try {
      ctx = new AudioContext({latencyHint: "interactive"});
      await ctx.resume();
      await ctx.audioWorklet.addModule("mic-worklet.js");
    } catch (err) {
      stop();
      showError(`Could not start audio processing: ${err && err.message ? err.message : err}`);
      return;
    }
    if (!running) return stop();
    outRate = OUT_RATES.includes(ctx.sampleRate) ? ctx.sampleRate : 24000;
    connect();
  }

  function connect() {
    const url = serverUrl();
    setConn("connecting", "connecting…");
    let opened = false;
    try {
      ws = new WebSocket(url);
    } catch (err) {
      stop();
      showError(`Bad server address ${url}: ${err.message}`);
      return;
    }
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      opened = true;
      ws.send(JSON.stringify({type: "start", version: 1, sample_rate: IN_RATE, output_sample_rate: outRate,
        encoding: "pcm_s16le"}));
    };
    ws.onmessage = (msg) => {
      try {
        if (typeof msg.data === "string") onEvent(msg.data);
        else onAudio(msg.data);
      } catch (err) { // a bug or a surprise from the server must not end the conversation
        showError(`Protocol error: could not handle a message from the server (${err.message})`);
      }
    };
    ws.onclose = (ev) => {
      if (ws === null || ev.target !== ws) return;
      const wasRunning = running;
      stop();
      if (!wasRunning) return;
      if (!opened) showError(`Cannot reach the voice server at ${url}. Is \`voice serve\` running?`);
      else if (ev.code !== 1000) {
        showError(`The server closed the connection (code ${ev.code}${ev.reason ? `: ${ev.reason}` : ""}).`);
      } else showError("The server ended the conversation.");
    };
  }

  function startMic() {
    const src = ctx.createMediaStreamSource(mic);
    micNode = new AudioWorkletNode(ctx, "mic-processor",
      {numberOfInputs: 1, numberOfOutputs: 1, outputChannelCount: [1]});
    micSink = ctx.createGain();
    micSink.gain.value = 0; // keep the worklet pulled by the graph without hearing ourselves
    src.connect(micNode).connect(micSink).connect(ctx.destination);
    micNode.port.onmessage = (e) => {
      if (!ws || ws.readyState !== WebSocket.OPEN || !connected) return;
      if (ws.bufferedAmount > MAX_BUFFERED_BYTES) { stats.framesDropped++; return; }
      ws.send(e.data);
      stats.framesSent++;
      stats.bytesSent += e.data.byteLength;
    };
  }

  function stop() {
    running = false;
    connected = false;
    speech = thinking = false;
    ui.toggle.textContent = "Start conversation";
    if (micNode) { micNode.port.postMessage("stop"); micNode.disconnect(); micNode = null; }
    if (mic) { mic.getTracks().forEach((t) => t.stop()); mic = null; }
    if (ws) {
      const s = ws;
      ws = null;
      if (s.readyState <= WebSocket.OPEN) s.close(1000, "bye");
    }
    clearPlayback(false);
    if (ctx) { ctx.close(); ctx = null; }
    ui.partial.textContent = "";
    setConn("idle", "not connected");
    updateActivity();
  }

  ui.toggle.addEventListener("click", () => (running ? stop() : start()));

  // --- events from the server -----------------------------------------------------------------

  function onEvent(text) {
    let ev;
    try {
      ev = JSON.parse(text);
    } catch (err) {
      showError(`Protocol error: the server sent text that is not JSON (${text.slice(0, 60)}…)`);
      return;
    }
    const type = ev && typeof ev === "object" ? ev.type : undefined;
    stats.events[type] = (stats.events[type] || 0) + 1;
    if (!EVENTS.has(type)) {
      showError(`Protocol error: unknown event ${JSON.stringify(type)} from the server (ignored).`);
      return;
    }
    const t = ev.turn !== undefined ? turnState(ev.turn) : null;
    switch (type) {
      case "ready":
        connected = true;
        stats.sessionId = ev.session_id;
        stats.outputRate = outRate = ev.sample_rate || outRate;
        setConn("connected", `connected · ${ev.session_id || "session"}`);
        startMic();
        break;
      case "speech_started":
        speech = true;
        ui.partial.textContent = "…";
        if (ev.resumes) turnState(ev.resumes).superseded = true;  // this turn's final holds that one's words
        break;
      case "speech_stopped":
        speech = false;
        thinking = true;
        t.eosAt = performance.now();
        break;
      case "transcript":
        if (!ev.final) {
          ui.partial.textContent = ev.text;
          break;
        }
        if (t.superseded) break;  // a later final (its `resumes`) holds these words
        ui.partial.textContent = "";
        stats.transcripts.push(ev.text);
        if (ev.resumes) {  // the user went on after a pause: this text replaces that turn's
          const earlier = turnState(ev.resumes);
          if (earlier.user) earlier.user.remove();
          earlier.user = null;
        }
        if (ev.text) t.user = addMessage("user", ev.text);
        else { thinking = false; addMessage("note", "(didn't catch that)"); }
        break;
      case "reply":
        audioTurn = ev.turn;
        if (!t.bot) t.bot = addMessage("bot", "");
        t.bot.querySelector(".text").textContent += ev.text;
        t.bot.title = `block ${ev.block}: ${ev.tokens} tokens in ${ev.steps} denoising steps`;
        break;
      case "reply_done":
        thinking = false;
        stats.replies.push(ev.text);
        if (!t.bot && ev.text) t.bot = addMessage("bot", "");
        if (t.bot) {
          t.bot.querySelector(".text").textContent = ev.text;
          if (ev.interrupted) {
            t.bot.classList.add("interrupted");
            const note = document.createElement("span");
            note.className = "heard";
            note.textContent = ev.heard ? `interrupted; you heard: “${ev.heard}”`
              : "interrupted before you heard it";
            t.bot.append(note);
          }
        }
        break;
      case "clear":
        stats.clears++;
        clearPlayback(true);
        break;
      case "latency":
        onLatency(ev, t);
        break;
      case "error":
        showError(`Server error (${ev.code}): ${ev.message}`);
        break;
    }
    updateActivity();
  }

  // --- reply audio ------------------------------------------------------------------------------

  function onAudio(buf) {
    stats.framesReceived++;
    stats.bytesReceived += buf.byteLength;
    if (!ctx || !connected) return;
    if (buf.byteLength % 2) {
      showError("Protocol error: an audio frame with an odd number of bytes was dropped.");
      return;
    }
    const pcm = new Int16Array(buf);
    if (!pcm.length) return;
    const samples = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
    const buffer = ctx.createBuffer(1, samples.length, outRate);
    buffer.copyToChannel(samples, 0);
    const src = ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(ctx.destination);
    const now = ctx.currentTime;
    if (playhead < now + 0.01) { // queue ran dry (or first frame): restart with a small lead
      if (playhead > 0) stats.underruns++;
      playhead = now + LEAD_S;
    }
    const t = turnState(audioTurn);
    if (t.firstAudioAt === null) {
      t.firstAudioAt = performance.now();
      t.playoutMs = (playhead - now) * 1000;
    }
    src.start(playhead);
    playhead += buffer.duration;
    sources.add(src);
    stats.audioFramesScheduled++;
    src.onended = () => {
      sources.delete(src);
      if (!src.cleared) {
        stats.audioFramesPlayed++;
        stats.bytesPlayed += buf.byteLength;
      }
      updateActivity();
    };
    thinking = false;
    updateActivity();
  }

  function clearPlayback(count) {
    for (const src of sources) {
      src.cleared = true;
      try { src.stop(); } catch (err) { /* not started yet on some engines */ }
    }
    sources.clear();
    playhead = 0;
    if (count) updateActivity();
  }

  // --- latency ----------------------------------------------------------------------------------

  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function niceStep(span, ticks) {
    const raw = span / ticks, mag = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  }

  function onLatency(ev, t) {
    stats.latencies.push(ev);
    const over = new Set(ev.over_budget || []);
    const stages = ev.stages_ms || {}, marks = ev.marks_ms || {};
    const bars = [];
    for (const [name, from] of STAGES) {
      if (stages[name] === undefined) continue;
      bars.push({name, start: marks[from] ?? 0, ms: stages[name], cls: over.has(name) ? "over" : "ok"});
    }
    if (t && t.playoutMs !== null && marks.first_audio_sent !== undefined) {
      bars.push({name: "playout (client)", start: marks.first_audio_sent, ms: t.playoutMs, cls: "client"});
    }
    const v2v = ev.voice_to_voice_ms ?? stages.voice_to_voice;
    if (v2v !== undefined && v2v !== null) {
      const cls = over.has("voice_to_voice") ? "over total" : "ok total";
      bars.push({name: "voice-to-voice", start: 0, ms: v2v, cls});
      history.push({turn: ev.turn, v2v, over: over.has("voice_to_voice")});
      if (history.length > HISTORY_TURNS) history.shift();
    }
    ui.v2v.textContent = v2v != null ? `· turn ${ev.turn}: ${Math.round(v2v)} ms voice-to-voice`
      : `· turn ${ev.turn}: no reply`;
    if (t && t.eosAt !== null && t.firstAudioAt !== null) {
      ui.v2v.title = `this page measured ${Math.round(t.firstAudioAt - t.eosAt)} ms from the server's ` +
        "end-of-speech event to the first reply audio";
    }
    drawWaterfall(bars);
    drawHistory();
  }

  function drawWaterfall(bars) {
    const el = ui.waterfall;
    el.replaceChildren();
    const width = el.clientWidth || 520, labelW = 130, rowH = 24, top = 6;
    const end = Math.max(1, ...bars.map((b) => b.start + b.ms));
    const step = niceStep(end, 5), scaleMax = Math.ceil(end / step) * step;
    const x = (ms) => labelW + (ms / scaleMax) * (width - labelW - 52);
    const height = top + bars.length * rowH + 22;
    el.setAttribute("height", height);
    for (let v = 0; v <= scaleMax + 1e-9; v += step) {
      el.append(svg("line", {x1: x(v), x2: x(v), y1: top, y2: height - 18, class: "grid"}));
      el.append(svg("text", {x: x(v), y: height - 5, class: "tick", "text-anchor": "middle"}, `${Math.round(v)}`));
    }
    el.append(svg("text", {x: width - 2, y: height - 5, class: "tick", "text-anchor": "end"}, "ms"));
    let drawn = 0;
    bars.forEach((b, i) => {
      const y = top + i * rowH;
      el.append(svg("text", {x: labelW - 8, y: y + rowH / 2 + 4, class: "label", "text-anchor": "end"}, b.name));
      const w = Math.max(2, x(b.start + b.ms) - x(b.start));
      const rect = svg("rect", {x: x(b.start), y: y + 4, width: w, height: rowH - 8, rx: 3, class: `bar ${b.cls}`,
        "data-stage": b.name});
      rect.append(svg("title", {}, `${b.name}: ${Math.round(b.ms)} ms (starts at ${Math.round(b.start)} ms)`));
      el.append(rect);
      el.append(svg("text", {x: x(b.start) + w + 4, y: y + rowH / 2 + 4, class: "value"}, `${Math.round(b.ms)}`));
      drawn++;
    });
    stats.waterfallBars = drawn;
  }

  function drawHistory() {
    const el = ui.history;
    el.replaceChildren();
    if (!history.length) return;
    const width = el.clientWidth || 520, height = 110, base = height - 18, slot = (width - 10) / HISTORY_TURNS;
    const maxV = Math.max(...history.map((h) => h.v2v), 1);
    history.forEach((h, i) => {
      const barH = Math.max(2, (h.v2v / maxV) * (base - 18));
      const bx = 5 + i * slot + slot * 0.15;
      const rect = svg("rect", {x: bx, y: base - barH, width: slot * 0.7, height: barH, rx: 2,
        class: `bar ${h.over ? "over" : "ok"}`});
      rect.append(svg("title", {}, `turn ${h.turn}: ${Math.round(h.v2v)} ms`));
      el.append(rect);
      el.append(svg("text", {x: bx + slot * 0.35, y: base - barH - 4, class: "value", "text-anchor": "middle"},
        `${Math.round(h.v2v)}`));
      el.append(svg("text", {x: bx + slot * 0.35, y: height - 4, class: "tick", "text-anchor": "middle"},
        `#${h.turn}`));
    });
  }

  window.addEventListener("unhandledrejection", (e) => {
    showError(`Unexpected error: ${e.reason && e.reason.message ? e.reason.message : e.reason}`);
  });
  updateActivity();
})();
