"""Which container the telemetry comes from: the OpenTelemetry resource of this server.

Containers on Modal and Replicate come and go by the hundred; a backend can only add them up,
and tell them apart, if every container says who it is. What the platform sets (Modal's task id,
environment and region; Replicate's model, version and deployment) becomes resource attributes,
beside the host name and the process id that every container has. `service.instance.id` is the
one attribute that must differ between containers (backends key series on it): Modal's task id
where there is one, else host name and process id.

The standard variables win over all of it: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are
read by the SDK's own detector and merged last.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from shared.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

SERVICE_NAME = "vllm-serverless-bundle"


def platform_attributes(settings: Settings) -> dict[str, str]:
    """The container's identity as attribute pairs (no empty values)."""
    host, pid = socket.gethostname(), os.getpid()
    attributes = {
        "service.name": SERVICE_NAME,
        "service.instance.id": settings.modal_task_id or f"{host}-{pid}",
        "host.name": host,
        "process.pid": str(pid),
    }
    found = {
        "modal.task_id": settings.modal_task_id,
        "modal.environment": settings.modal_environment,
        "cloud.region": settings.modal_region,
        "replicate.model": settings.replicate_model_name,
        "replicate.version": settings.replicate_version_id,
        "replicate.deployment": settings.replicate_deployment_name,
    }
    attributes.update({key: value for key, value in found.items() if value})
    if settings.modal_task_id:
        attributes["cloud.platform"] = "modal"
    elif settings.replicate_model_name or settings.replicate_version_id:
        attributes["cloud.platform"] = "replicate"
    return attributes


def resource_for(settings: Settings) -> Resource:
    """The SDK resource: the SDK's defaults (telemetry.sdk.*), this container's attributes, then
    whatever OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES say (the later merge wins)."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    return Resource.create(platform_attributes(settings)).merge(OTELResourceDetector().detect())
