// AudioWorklet: microphone samples at the context's rate -> 16 kHz PCM16, posted in 20 ms frames.
//
// Resampling is a windowed-sinc low-pass (cutoff just under 8 kHz, so nothing aliases into the
// 16 kHz band) followed by linear interpolation at the fractional input positions. That is
// correct for any input rate (48000, 44100, ...) and cheap enough for the audio thread.

const OUT_RATE = 16000;
const FRAME = OUT_RATE / 50; // 20 ms = 320 samples

function lowpassTaps(inRate, cutoffHz, n) {
  const fc = cutoffHz / inRate;
  const taps = new Float32Array(n);
  const mid = (n - 1) / 2;
  let sum = 0;
  for (let i = 0; i < n; i++) {
    const x = i - mid;
    const sinc = x === 0 ? 2 * fc : Math.sin(2 * Math.PI * fc * x) / (Math.PI * x);
    const blackman = 0.42 - 0.5 * Math.cos((2 * Math.PI * i) / (n - 1)) + 0.08 * Math.cos((4 * Math.PI * i) / (n - 1));
    taps[i] = sinc * blackman;
    sum += taps[i];
  }
  for (let i = 0; i < n; i++) taps[i] /= sum; // unity gain at DC
  return taps;
}

class MicProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.inRate = sampleRate; // AudioWorkletGlobalScope's rate of the context
    this.step = this.inRate / OUT_RATE; // input samples per output sample
    this.filter = this.inRate > OUT_RATE;
    this.taps = this.filter ? lowpassTaps(this.inRate, 7200, 63) : null;
    this.hist = new Float32Array(this.taps ? this.taps.length : 1); // circular FIR history
    this.histPos = 0;
    this.prev = 0; // last filtered sample (for interpolating across render quanta)
    this.pos = 0; // position of the next output sample, in input samples after `prev`
    this.frame = new Int16Array(FRAME);
    this.fill = 0;
    this.running = true;
    this.port.onmessage = (e) => { if (e.data === "stop") this.running = false; };
  }

  filtered(x) {
    if (!this.filter) return x;
    const h = this.hist, taps = this.taps, n = h.length;
    h[this.histPos] = x;
    let acc = 0, j = this.histPos;
    for (let i = 0; i < n; i++) {
      acc += taps[i] * h[j];
      j = j === 0 ? n - 1 : j - 1;
    }
    this.histPos = this.histPos + 1 === n ? 0 : this.histPos + 1;
    return acc;
  }

  emit(v) {
    const s = Math.max(-1, Math.min(1, v));
    this.frame[this.fill++] = s < 0 ? s * 32768 : s * 32767;
    if (this.fill === FRAME) {
      const out = this.frame;
      this.port.postMessage(out.buffer, [out.buffer]);
      this.frame = new Int16Array(FRAME);
      this.fill = 0;
    }
  }

  process(inputs) {
    const input = inputs[0];
    if (!this.running) return false;
    if (!input || input.length === 0) return true;
    const chans = input.length, len = input[0].length;
    for (let i = 0; i < len; i++) {
      let x = 0;
      for (let c = 0; c < chans; c++) x += input[c][i];
      const cur = this.filtered(x / chans);
      // Output samples falling in (prev, cur]: pos is measured from prev, in input samples.
      while (this.pos <= 1) {
        this.emit(this.prev + (cur - this.prev) * this.pos);
        this.pos += this.step;
      }
      this.pos -= 1;
      this.prev = cur;
    }
    return true;
  }
}

registerProcessor("mic-processor", MicProcessor);
