// The browser side of pie-engine-wgpu's browser device: a WebGPU device that runs what the engine sends.
//
// The engine (Python, pie_engine_wgpu/browser_backend.py) serves this page from 127.0.0.1 under a random
// token and talks to it over one binary WebSocket. Each message from the engine is a batch of commands
// (create/write/clear buffers, create pipelines from the shipped WGSL, bind groups, dispatches, a read);
// the page records all of a message's GPU work into ONE command buffer and submits it once. Writes that
// come after recorded work go through a staging copy inside that command buffer, so they land in order.
// A message that asks for a reply is answered with the bytes it read (or nothing); an error while handling
// any message, and the device being lost, are reported as frames of their own.
// The wire format is pie_engine_wgpu/protocol.py; the constants below must match it (a test checks).
"use strict";

const OP = {
  CREATE_BUFFER: 1,
  DESTROY_BUFFER: 2,
  WRITE: 3,
  CLEAR: 4,
  PIPELINE: 5,
  BIND_GROUP: 6,
  DISPATCH: 7,
  FORGET_BIND_GROUPS: 8,
  READ: 9,
};
const FRAME = { REPLY: 1, ERROR: 2, LOST: 3, HELLO: 4, FATAL: 5 };
const WANT_REPLY = 1;
const PARAMS_BUFFER = 0;
const PARAMS_CAPACITY = 1048576;
const BINDING_TYPES = ["uniform", "read-only-storage", "storage"];
const FRAME_HEADER_BYTES = 20;

const statusLine = document.getElementById("status");
const socket = new WebSocket(
  "ws://" + location.host + location.pathname.replace(/[^/]*$/, "") + "socket",
);
socket.binaryType = "arraybuffer";

let device = null;
let paramsBuffer = null;
let submissions = 0;
let closing = false;
let queue = Promise.resolve();
const buffers = new Map();
const pipelines = new Map();
const groups = new Map();
const decoder = new TextDecoder();
const encoder = new TextEncoder();

function show(text) {
  statusLine.textContent = text;
}

function send(kind, seq, payload, pageMs, recordMs) {
  const body = payload || new Uint8Array(0);
  const out = new Uint8Array(FRAME_HEADER_BYTES + body.byteLength);
  const view = new DataView(out.buffer);
  view.setUint32(0, kind, true);
  view.setUint32(4, seq, true);
  view.setUint32(8, submissions, true);
  view.setFloat32(12, pageMs || 0, true);
  view.setFloat32(16, recordMs || 0, true);
  out.set(body, FRAME_HEADER_BYTES);
  if (socket.readyState === WebSocket.OPEN) socket.send(out);
}

function sendText(kind, seq, text) {
  send(kind, seq, encoder.encode(text));
}

async function start() {
  if (!navigator.gpu) {
    throw new Error(
      "navigator.gpu is missing: WebGPU is off in this browser (Chromium on Linux needs --enable-unsafe-webgpu)",
    );
  }
  // The engine puts the chosen adapter's requestAdapter() options in the fragment, as JSON.
  const options = JSON.parse(decodeURIComponent(location.hash.slice(1)) || "{}");
  const adapter = await navigator.gpu.requestAdapter(options);
  if (!adapter) {
    throw new Error(`navigator.gpu.requestAdapter(${JSON.stringify(options)}) found no WebGPU adapter`);
  }
  // Every limit as high as the adapter goes: a compatibility-level adapter's defaults are below what the
  // kernels need (workgroups of 256, more than four storage buffers).
  const requiredLimits = {};
  for (const name in adapter.limits) requiredLimits[name] = adapter.limits[name];
  device = await adapter.requestDevice({ requiredLimits });
  device.lost.then((info) => {
    if (!closing) sendText(FRAME.LOST, 0, `${info.reason}: ${info.message}`);
  });
  device.onuncapturederror = (event) => sendText(FRAME.ERROR, 0, event.error.message);
  paramsBuffer = device.createBuffer({
    size: PARAMS_CAPACITY,
    usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST,
  });
  const info = adapter.info || {};
  const hello = {
    vendor: info.vendor || "",
    architecture: info.architecture || "",
    device: info.device || "",
    description: info.description || "",
    backend: info.backend || "", // with --enable-webgpu-developer-features
    type: info.type || "",
    fallback: Boolean(info.isFallbackAdapter),
    user_agent: navigator.userAgent,
    limits: {
      min_storage_buffer_offset_alignment: device.limits.minStorageBufferOffsetAlignment,
      min_uniform_buffer_offset_alignment: device.limits.minUniformBufferOffsetAlignment,
      max_storage_buffer_binding_size: device.limits.maxStorageBufferBindingSize,
      max_buffer_size: device.limits.maxBufferSize,
      max_storage_buffers_per_shader_stage: device.limits.maxStorageBuffersPerShaderStage,
    },
  };
  sendText(FRAME.HELLO, 0, JSON.stringify(hello));
  show(`running on ${hello.vendor} ${hello.architecture}`);
}

// -- one message ------------------------------------------------------------------------------

class Reader {
  constructor(data) {
    this.data = data;
    this.words = new Uint32Array(data, 0, data.byteLength >> 2);
    this.at = 0; // in words
  }
  more() {
    return this.at < this.words.length;
  }
  u32() {
    return this.words[this.at++];
  }
  bytes(size) {
    const view = new Uint8Array(this.data, this.at * 4, size);
    this.at += (size + 3) >> 2;
    return view;
  }
  text() {
    return decoder.decode(this.bytes(this.u32()));
  }
}

function buffer(id) {
  if (id === PARAMS_BUFFER) return paramsBuffer;
  const found = buffers.get(id);
  if (!found) throw new Error(`buffer ${id} does not exist`);
  return found;
}

async function createPipeline(r) {
  const id = r.u32();
  const paramsSize = r.u32();
  const count = r.u32();
  const entries = [];
  for (let i = 0; i < count; i++) {
    const binding = r.u32();
    const type = BINDING_TYPES[r.u32()];
    const layout = type === "uniform"
      ? { type, hasDynamicOffset: true, minBindingSize: paramsSize }
      : { type };
    entries.push({ binding, visibility: GPUShaderStage.COMPUTE, buffer: layout });
  }
  const name = r.text();
  const code = r.text();
  const groupLayout = device.createBindGroupLayout({ entries });
  const module = device.createShaderModule({ label: name, code });
  let pipeline;
  try {
    pipeline = await device.createComputePipelineAsync({
      label: name,
      layout: device.createPipelineLayout({ bindGroupLayouts: [groupLayout] }),
      compute: { module, entryPoint: name },
    });
  } catch (error) {
    const info = await module.getCompilationInfo();
    const notes = info.messages.map((m) => `${m.type} at ${m.lineNum}:${m.linePos}: ${m.message}`);
    throw new Error(`pipeline ${name}: ${error.message}${notes.length ? "\n" + notes.join("\n") : ""}`);
  }
  pipelines.set(id, { pipeline, groupLayout });
}

function createBindGroup(r) {
  const id = r.u32();
  const pipelineId = r.u32();
  const count = r.u32();
  const entries = [];
  for (let i = 0; i < count; i++) {
    const binding = r.u32();
    const source = r.u32();
    const offset = r.u32();
    const size = r.u32();
    entries.push({ binding, resource: { buffer: buffer(source), offset, size } });
  }
  const found = pipelines.get(pipelineId);
  if (!found) throw new Error(`pipeline ${pipelineId} does not exist`);
  groups.set(id, { group: device.createBindGroup({ layout: found.groupLayout, entries }), pipeline: found.pipeline });
}

async function handle(data) {
  const started = performance.now();
  const r = new Reader(data);
  const seq = r.u32();
  const flags = r.u32();
  const params = r.bytes(r.u32());
  let commands = null;
  let pass = null;
  let lastPipeline = null;
  let readback = null;
  const staging = [];
  const doomed = [];
  const open = () => {
    if (!commands) commands = device.createCommandEncoder();
    return commands;
  };
  const copies = () => {
    if (pass) {
      pass.end();
      pass = null;
      lastPipeline = null;
    }
    return open();
  };
  device.pushErrorScope("out-of-memory");
  device.pushErrorScope("validation");
  let failure = null;
  let recorded = started;
  try {
    while (r.more()) {
      const op = r.u32();
      if (op === OP.CREATE_BUFFER) {
        const id = r.u32();
        const size = r.u32();
        buffers.set(id, device.createBuffer({
          size,
          usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
        }));
      } else if (op === OP.DESTROY_BUFFER) {
        const id = r.u32();
        doomed.push(buffer(id));
        buffers.delete(id);
      } else if (op === OP.WRITE) {
        const target = buffer(r.u32());
        const offset = r.u32();
        const size = r.u32();
        const bytes = r.bytes(size);
        if (!commands) {
          device.queue.writeBuffer(target, offset, bytes);
        } else {
          // Recorded work comes first: copy from a staging buffer inside the same command buffer.
          const padded = (size + 3) & ~3;
          const stage = device.createBuffer({ size: padded, usage: GPUBufferUsage.COPY_SRC, mappedAtCreation: true });
          new Uint8Array(stage.getMappedRange()).set(bytes);
          stage.unmap();
          staging.push(stage);
          copies().copyBufferToBuffer(stage, 0, target, offset, padded);
        }
      } else if (op === OP.CLEAR) {
        const target = buffer(r.u32());
        const offset = r.u32();
        const size = r.u32();
        copies().clearBuffer(target, offset, size);
      } else if (op === OP.PIPELINE) {
        await createPipeline(r);
      } else if (op === OP.BIND_GROUP) {
        createBindGroup(r);
      } else if (op === OP.DISPATCH) {
        const found = groups.get(r.u32());
        const paramsOffset = r.u32();
        const x = r.u32();
        const y = r.u32();
        const z = r.u32();
        if (!found) throw new Error("dispatch of a bind group that does not exist");
        if (!pass) pass = open().beginComputePass();
        if (found.pipeline !== lastPipeline) {
          pass.setPipeline(found.pipeline);
          lastPipeline = found.pipeline;
        }
        pass.setBindGroup(0, found.group, [paramsOffset]);
        pass.dispatchWorkgroups(x, y, z);
      } else if (op === OP.FORGET_BIND_GROUPS) {
        groups.clear();
      } else if (op === OP.READ) {
        const count = r.u32();
        const ranges = [];
        let total = 0;
        for (let i = 0; i < count; i++) {
          const source = buffer(r.u32());
          const offset = r.u32();
          const size = r.u32();
          ranges.push([source, offset, size]);
          total += size;
        }
        readback = device.createBuffer({ size: total, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
        const record = copies();
        let at = 0;
        for (const [source, offset, size] of ranges) {
          record.copyBufferToBuffer(source, offset, readback, at, size);
          at += size;
        }
      } else {
        throw new Error(`unknown command ${op}`);
      }
    }
    if (pass) pass.end();
    if (commands) {
      if (params.byteLength) device.queue.writeBuffer(paramsBuffer, 0, params);
      device.queue.submit([commands.finish()]);
      submissions += 1;
    }
    recorded = performance.now();
  } catch (error) {
    failure = error.message || String(error);
  }
  for (const stage of staging) stage.destroy();
  for (const doomedBuffer of doomed) doomedBuffer.destroy();
  const validation = await device.popErrorScope();
  const memory = await device.popErrorScope();
  failure = failure || (validation && validation.message) || (memory && `out of memory: ${memory.message}`);
  let payload = null;
  if (!failure && readback) {
    try {
      await readback.mapAsync(GPUMapMode.READ);
      payload = new Uint8Array(readback.getMappedRange()).slice();
    } catch (error) {
      failure = `reading results back failed: ${error.message}`;
    }
  }
  if (!failure && !readback && flags & WANT_REPLY) await device.queue.onSubmittedWorkDone();
  if (readback) readback.destroy();
  if (failure) {
    sendText(FRAME.ERROR, seq, failure);
  } else if (flags & WANT_REPLY) {
    send(FRAME.REPLY, seq, payload, performance.now() - started, recorded - started);
  }
}

socket.onopen = () => {
  show("connected");
  queue = queue.then(start).catch((error) => sendText(FRAME.FATAL, 0, error.message || String(error)));
};
socket.onmessage = (event) => {
  queue = queue.then(() => handle(event.data)).catch((error) => sendText(FRAME.ERROR, 0, String(error)));
};
socket.onclose = () => {
  closing = true;
  show("the engine closed the connection");
  if (device) device.destroy();
  window.close(); // a page the engine opened in the user's own browser goes with it (where allowed)
};
