"""What the shader engines' own hooks (engine info, kernel source) have in common."""

from __future__ import annotations

from pie.contract import CONTRACT_VERSION, EngineInfo, KernelRequest, RegionRequest
from pie.enginekit.host import may_have_hardware_gpu
from pie.enginekit.shaders.launch import VARIANTS, entry_names


def shader_engine_info(
    name: str, kernel_language: str, description: str, priority: int, software_only_priority: int
) -> EngineInfo:
    """An engine's description; ranked ``software_only_priority`` where the host can have no GPU driver, since
    its only devices there are software ones, slower than the CPU engine (:func:`may_have_hardware_gpu`)."""
    return EngineInfo(
        name=name,
        contract_version=CONTRACT_VERSION,
        priority=priority if may_have_hardware_gpu() else software_only_priority,
        kernel_languages=(kernel_language,),
        description=description,
    )


def shipped_entry_names(request: KernelRequest | RegionRequest) -> list[str]:
    """The shipped entry points a kernel request may launch; none for a region or a kernel not in the catalogue."""
    if not isinstance(request, KernelRequest) or request.name not in VARIANTS:
        return []
    return entry_names(request.name)
