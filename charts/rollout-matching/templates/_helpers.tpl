{{/* Names */}}
{{- define "rm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rm.labels" -}}
{{ include "rm.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rm.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{/* The server URLs the learner talks to, in instance order. */}}
{{- define "rm.serverUrls" -}}
{{- $urls := list -}}
{{- range .Values.rolloutServer.instances -}}
{{- $urls = append $urls (printf "http://%s:%v" $.Values.rolloutServer.host .port) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* "0,1,..,n-1": container-local device indexes for n GPUs. */}}
{{- define "rm.localDevices" -}}
{{- $ids := list -}}
{{- range $i, $_ := . -}}
{{- $ids = append $ids $i -}}
{{- end -}}
{{- join "," $ids -}}
{{- end -}}

{{/*
Topology rules the schema cannot express. Fails the render with the offending key and what to do.
*/}}
{{- define "rm.validate" -}}
{{- $v := .Values -}}
{{- $perServer := mul $v.rolloutServer.tensorParallelSize $v.rolloutServer.dataParallelSize -}}
{{- $seenPorts := dict -}}
{{- $seenGpus := dict -}}
{{- range $i, $inst := $v.rolloutServer.instances -}}
{{- if ne (len $inst.gpus) (int $perServer) -}}
{{- fail (printf "rolloutServer.instances[%d] (port %v) lists %d GPU(s) but tensorParallelSize × dataParallelSize = %d; list exactly %d GPU id(s)" $i $inst.port (len $inst.gpus) (int $perServer) (int $perServer)) -}}
{{- end -}}
{{- $p := toString $inst.port -}}
{{- if hasKey $seenPorts $p -}}
{{- fail (printf "rolloutServer.instances[%d]: port %s is already used by %s; every server on the node needs its own port" $i $p (get $seenPorts $p)) -}}
{{- end -}}
{{- $_ := set $seenPorts $p (printf "rolloutServer.instances[%d]" $i) -}}
{{- range $inst.gpus -}}
{{- $g := toString . -}}
{{- if hasKey $seenGpus $g -}}
{{- fail (printf "rolloutServer.instances[%d]: GPU %s is already assigned to %s; device sets must be disjoint" $i $g (get $seenGpus $g)) -}}
{{- end -}}
{{- if ge (int .) (int $v.node.gpuCount) -}}
{{- fail (printf "rolloutServer.instances[%d]: GPU %s does not exist on a node with node.gpuCount=%v (ids are 0..%d)" $i $g $v.node.gpuCount (sub (int $v.node.gpuCount) 1)) -}}
{{- end -}}
{{- $_ := set $seenGpus $g (printf "rolloutServer.instances[%d]" $i) -}}
{{- end -}}
{{- end -}}
{{- range $v.learner.gpus -}}
{{- $g := toString . -}}
{{- if hasKey $seenGpus $g -}}
{{- fail (printf "learner.gpus: GPU %s is already assigned to %s; device sets must be disjoint" $g (get $seenGpus $g)) -}}
{{- end -}}
{{- if ge (int .) (int $v.node.gpuCount) -}}
{{- fail (printf "learner.gpus: GPU %s does not exist on a node with node.gpuCount=%v (ids are 0..%d)" $g $v.node.gpuCount (sub (int $v.node.gpuCount) 1)) -}}
{{- end -}}
{{- $_ := set $seenGpus $g "learner.gpus" -}}
{{- end -}}
{{- if gt (len $seenGpus) (int $v.node.gpuCount) -}}
{{- fail (printf "the topology uses %d GPUs but node.gpuCount is %v" (len $seenGpus) $v.node.gpuCount) -}}
{{- end -}}
{{- if ne (int $v.learner.nprocPerNode) (len $v.learner.gpus) -}}
{{- fail (printf "learner.nprocPerNode is %v but learner.gpus lists %d GPU(s); torchrun starts one process per GPU, make them equal" $v.learner.nprocPerNode (len $v.learner.gpus)) -}}
{{- end -}}
{{- if and (ne $v.rolloutServer.engine "scripted") (ne $v.rolloutServer.engine "hf") (not $v.rolloutServer.model) $v.rolloutServer.instances -}}
{{- fail (printf "rolloutServer.model is empty but engine %s needs a model directory (e.g. /models/policy under storage.models)" $v.rolloutServer.engine) -}}
{{- end -}}
{{- if and (gt (int $v.rolloutServer.dataParallelSize) 1) (ne $v.rolloutServer.engine "swift") -}}
{{- fail (printf "rolloutServer.dataParallelSize is %v but engine %s runs one engine per server; use engine swift for data parallelism, or one instance per GPU group" $v.rolloutServer.dataParallelSize $v.rolloutServer.engine) -}}
{{- end -}}
{{- if and $v.rolloutServer.instances (not (has $v.rolloutServer.host (list "127.0.0.1" "localhost" "::1"))) -}}
{{- fail (printf "rolloutServer.host is %s: servers share the node's host network and must bind the loopback (127.0.0.1)" $v.rolloutServer.host) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the training config is a GRPO one (an `rlhf` section): servers then read it too. */}}
{{- define "rm.isGrpo" -}}
{{- if hasKey .Values.learner.config "rlhf" -}}true{{- end -}}
{{- end -}}

{{/*
The training YAML with the topology written in: server mode and the server list when there are servers.
*/}}
{{- define "rm.trainConfig" -}}
{{- $v := .Values -}}
{{- $cfg := deepCopy $v.learner.config -}}
{{- if $v.rolloutServer.instances -}}
{{- $hosts := list -}}
{{- $ports := list -}}
{{- $servers := list -}}
{{- range $v.rolloutServer.instances -}}
{{- $hosts = append $hosts $v.rolloutServer.host -}}
{{- $ports = append $ports (int .port) -}}
{{- $servers = append $servers (dict "base_url" (printf "http://%s:%v" $v.rolloutServer.host .port)) -}}
{{- end -}}
{{- if hasKey $cfg "rlhf" -}}
{{- $rs := dict "vllm_tensor_parallel_size" (int $v.rolloutServer.tensorParallelSize) "vllm_data_parallel_size" (int $v.rolloutServer.dataParallelSize) "vllm_gpu_memory_utilization" $v.rolloutServer.gpuMemoryUtilization "vllm_max_model_len" (int $v.rolloutServer.maxModelLen) -}}
{{- $patch := dict "rlhf" (dict "vllm_mode" "server" "vllm_server_host" $hosts "vllm_server_port" $ports) "custom" (dict "extra" (dict "rollout_server" $rs)) -}}
{{- $cfg = mustMergeOverwrite $cfg $patch -}}
{{- else -}}
{{- $patch := dict "custom" (dict "extra" (dict "rollout_matching" (dict "rollout_backend" "vllm" "vllm" (dict "mode" "server" "server" (dict "servers" $servers))))) -}}
{{- $cfg = mustMergeOverwrite $cfg $patch -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Pod-level scheduling: one node for the whole release. */}}
{{- define "rm.scheduling" -}}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- if .Values.nccl.hostIPC }}
hostIPC: true
{{- end }}
{{- $sel := deepCopy .Values.node.selector }}
{{- if .Values.node.name }}
{{- $_ := set $sel "kubernetes.io/hostname" .Values.node.name }}
{{- end }}
{{- with $sel }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
affinity:
  podAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "rm.selectorLabels" . | nindent 12 }}
{{- with .Values.node.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.securityContext.runAsUser }}
  runAsGroup: {{ .Values.securityContext.runAsGroup }}
  fsGroup: {{ .Values.securityContext.fsGroup }}
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "rm.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/* Environment shared by every container: writable caches under emptyDirs, NCCL, user extras. */}}
{{- define "rm.commonEnv" -}}
- name: HOME
  value: /home/app
- name: XDG_CACHE_HOME
  value: /home/app/.cache
- name: HF_HOME
  value: /home/app/.cache/huggingface
- name: TRITON_CACHE_DIR
  value: /home/app/.cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /tmp/torchinductor
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
{{- range $k, $val := .Values.nccl.env }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- range $k, $val := .Values.env }}
- name: {{ $k }}
  value: {{ $val | toString | quote }}
{{- end }}
{{- end -}}

{{/* GPU env + resources for a device list. Args: dict "root" $ "gpus" LIST "resources" MAP */}}
{{- define "rm.gpuEnv" -}}
- name: CUDA_VISIBLE_DEVICES
  value: {{ include "rm.localDevices" .gpus | quote }}
{{- if eq .root.Values.gpu.assignment "visibleDevices" }}
- name: NVIDIA_VISIBLE_DEVICES
  value: {{ join "," .gpus | quote }}
{{- end }}
{{- end -}}

{{- define "rm.resources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if eq .root.Values.gpu.assignment "devicePlugin" -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $_ := set $limits .root.Values.gpu.resourceName (len .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
resources:
  {{- toYaml $res | nindent 2 }}
{{- end -}}

{{/* Writable scratch volumes (the root filesystem is read-only). */}}
{{- define "rm.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- end -}}

{{- define "rm.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/app/.cache
- name: dshm
  mountPath: /dev/shm
{{- end -}}

{{- define "rm.hostDirVolume" -}}
- name: {{ .name }}
{{- if .spec.hostPath }}
  hostPath:
    path: {{ .spec.hostPath }}
    type: {{ .hostPathType | default "Directory" }}
{{- else if .spec.sizeLimit }}
  emptyDir:
    sizeLimit: {{ .spec.sizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}
