"""Entry point ``pie.engines: metal``: the Metal engine bound to this Mac's GPUs through PyObjC.

Importing this module does not import PyObjC; probing does. Off macOS
the probe raises with the reason, so the engine is listed as broken, not hidden.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from functools import partial

from pie_engine_metal import probe
from pie_engine_metal.engine import DeviceHandle, MetalEngine


def _discover() -> Sequence[DeviceHandle]:
    from pie_engine_metal.metal import MetalDriver

    os_version = platform.mac_ver()[0]
    supported = [device for device in probe.system_devices() if probe.runs_kernels(probe.families(device))]
    return [
        DeviceHandle(probe.describe(index, device, os_version=os_version), partial(MetalDriver, device))
        for index, device in enumerate(supported)
    ]


engine = MetalEngine(_discover, probe.diagnose)

pie_engine_info = engine.pie_engine_info
pie_probe_devices = engine.pie_probe_devices
pie_diagnose = engine.pie_diagnose
pie_device_profiles = engine.pie_device_profiles
pie_list_kernels = engine.pie_list_kernels
pie_compile_kernel = engine.pie_compile_kernel
pie_compile_block = engine.pie_compile_block
pie_kernel_source = engine.pie_kernel_source
pie_synchronize = engine.pie_synchronize
pie_allocate_pages = engine.pie_allocate_pages
pie_free_pages = engine.pie_free_pages
pie_read_pages = engine.pie_read_pages
pie_write_pages = engine.pie_write_pages
pie_copy_pages = engine.pie_copy_pages
pie_kv_dtypes = engine.pie_kv_dtypes
pie_begin_pass = engine.pie_begin_pass
pie_end_pass = engine.pie_end_pass
pie_upload = engine.pie_upload
pie_weight_types = engine.pie_weight_types
pie_upload_weights = engine.pie_upload_weights
pie_download = engine.pie_download
