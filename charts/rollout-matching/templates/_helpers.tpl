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
rollout-matching/run: {{ .Release.Name }}
{{- end -}}

{{- define "rm.labels" -}}
{{ include "rm.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* repository:tag, or the repository alone when tag is empty (a full reference, e.g. with a digest). */}}
{{- define "rm.image" -}}
{{- if .tag -}}{{- printf "%s:%s" .repository .tag -}}{{- else -}}{{- .repository -}}{{- end -}}
{{- end -}}

{{/*
Ports: the ONE place every port a pod opens is derived from its index (servers 0..n-1, the learner n).
Args: dict "root" $ "index" N. Returns YAML (use with fromYaml). Layout: values.yaml `ports`.
*/}}
{{- define "rm.ports" -}}
{{- $p := .root.Values.ports -}}
{{- $first := add (int $p.base) (mul (int .index) (int $p.blockSize)) -}}
first: {{ $first }}
last: {{ sub (add $first (int $p.blockSize)) 1 }}
rendezvous: {{ $first }}
serverVllm: {{ add $first 1 }}
control: {{ add $first 1 }}
groupBase: {{ add $first 2 }}
learnerVllm: {{ add $first 50 }}
{{- end -}}

{{- define "rm.learnerPorts" -}}
{{- include "rm.ports" (dict "root" . "index" (len .Values.rolloutServer.instances)) -}}
{{- end -}}

{{/* Port env of a pod. Args: dict "root" $ "index" N "role" "server"|"learner" */}}
{{- define "rm.portEnv" -}}
{{- $ports := fromYaml (include "rm.ports" .) -}}
{{- if eq .role "server" }}
- name: VLLM_PORT
  value: {{ $ports.serverVllm | quote }}
- name: VLLM_DP_MASTER_PORT
  value: {{ $ports.rendezvous | quote }}
{{- else }}
- name: MASTER_PORT
  value: {{ $ports.rendezvous | quote }}
- name: PET_MASTER_PORT
  value: {{ $ports.rendezvous | quote }}
- name: VLLM_PORT
  value: {{ $ports.learnerVllm | quote }}
{{- end }}
{{- end -}}

{{- define "rm.portAnnotation" -}}
{{- $ports := fromYaml (include "rm.ports" .) -}}
rollout-matching/ports: {{ printf "%v-%v" $ports.first $ports.last | quote }}
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
{{- $n := len $v.rolloutServer.instances -}}
{{- if gt $n 48 -}}
{{- fail (printf "rolloutServer.instances lists %d servers; the learner's port block holds weight-sync group ports for at most 48" $n) -}}
{{- end -}}
{{- $portsEnd := add (int $v.ports.base) (mul (add $n 1) (int $v.ports.blockSize)) -}}
{{- if gt $portsEnd 65536 -}}
{{- fail (printf "ports.base %v + %d blocks of ports.blockSize %v ends past 65535; lower ports.base" $v.ports.base (add $n 1) $v.ports.blockSize) -}}
{{- end -}}
{{- range $i, $inst := $v.rolloutServer.instances -}}
{{- if and (ge (int $inst.port) (int $v.ports.base)) (lt (int $inst.port) $portsEnd) -}}
{{- fail (printf "rolloutServer.instances[%d]: port %v lies in the internal port blocks %v-%d (ports.base, ports.blockSize); choose a port outside them or move ports.base" $i $inst.port $v.ports.base (sub $portsEnd 1)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.metrics.podMonitor.enabled (not $v.metrics.enabled) -}}
{{- fail "metrics.podMonitor.enabled needs metrics.enabled (the ports it scrapes)" -}}
{{- end -}}
{{- if $v.metrics.enabled -}}
{{- range $i, $inst := $v.rolloutServer.instances -}}
{{- $mp := add (int $inst.port) (int $v.metrics.serverPortOffset) -}}
{{- if gt $mp 65535 -}}
{{- fail (printf "rolloutServer.instances[%d]: metrics port %d (port + metrics.serverPortOffset) is past 65535" $i $mp) -}}
{{- end -}}
{{- if hasKey $seenPorts (toString $mp) -}}
{{- fail (printf "rolloutServer.instances[%d]: metrics port %d is the HTTP port of %s; change metrics.serverPortOffset" $i $mp (get $seenPorts (toString $mp))) -}}
{{- end -}}
{{- if and (ge $mp (int $v.ports.base)) (lt $mp $portsEnd) -}}
{{- fail (printf "rolloutServer.instances[%d]: metrics port %d lies in the internal port blocks %v-%d; change metrics.serverPortOffset" $i $mp $v.ports.base (sub $portsEnd 1)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $out := $v.storage.output -}}
{{- if and (not $out.hostPath) (not $out.claimName) (not $out.ephemeral) -}}
{{- fail "storage.output: the learner's checkpoints need a volume that outlives the pod; set storage.output.hostPath (a node directory writable by securityContext.runAsUser, e.g. --set storage.output.hostPath=/data/runs) or storage.output.claimName (a PVC), or storage.output.ephemeral=true to lose them with the pod" -}}
{{- end -}}
{{- if and $out.ephemeral (or $out.hostPath $out.claimName) -}}
{{- fail "storage.output.ephemeral is true but storage.output names a hostPath or claimName; drop one of them" -}}
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
{{- $groupBase := int (fromYaml (include "rm.learnerPorts" $)).groupBase -}}
{{- $groupPorts := list -}}
{{- range $i, $_ := $v.rolloutServer.instances -}}
{{- $groupPorts = append $groupPorts (add $groupBase $i) -}}
{{- end -}}
{{- if hasKey $cfg "rlhf" -}}
{{- $rs := dict "vllm_tensor_parallel_size" (int $v.rolloutServer.tensorParallelSize) "vllm_data_parallel_size" (int $v.rolloutServer.dataParallelSize) -}}
{{- if not (kindIs "invalid" $v.rolloutServer.gpuMemoryUtilization) -}}
{{- $_ := set $rs "vllm_gpu_memory_utilization" $v.rolloutServer.gpuMemoryUtilization -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.rolloutServer.maxModelLen) -}}
{{- $_ := set $rs "vllm_max_model_len" (int $v.rolloutServer.maxModelLen) -}}
{{- end -}}
{{- $patch := dict "rlhf" (dict "vllm_mode" "server" "vllm_server_host" $hosts "vllm_server_port" $ports "vllm_server_group_port" $groupPorts) "custom" (dict "extra" (dict "rollout_server" $rs)) -}}
{{- $cfg = mustMergeOverwrite $cfg $patch -}}
{{- else -}}
{{- $patch := dict "custom" (dict "extra" (dict "rollout_matching" (dict "rollout_backend" "vllm" "vllm" (dict "mode" "server" "server" (dict "servers" $servers) "sync" (dict "group_port" $groupBase))))) -}}
{{- $cfg = mustMergeOverwrite $cfg $patch -}}
{{- end -}}
{{- end -}}
{{- if and $v.metrics.enabled (not (kindIs "invalid" $v.metrics.learnerPort)) -}}
{{- $host := $v.metrics.host | default "${POD_IP}" -}}
{{- $cfg = mustMergeOverwrite $cfg (dict "training" (dict "metrics_port" (int $v.metrics.learnerPort) "metrics_host" $host)) -}}
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
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
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
{{/* "true" when the servers serve Prometheus metrics on their own port (metrics.enabled, a trainer-serve engine). */}}
{{- define "rm.serverMetrics" -}}
{{- if and .Values.metrics.enabled (ne .Values.rolloutServer.engine "swift") .Values.rolloutServer.instances -}}true{{- end -}}
{{- end -}}

{{/* Bind address of the metrics ports: metrics.host, else the pod IP (from POD_IP, set by rm.metricsEnv). */}}
{{- define "rm.metricsHost" -}}
{{- .Values.metrics.host | default "$(POD_IP)" -}}
{{- end -}}

{{- define "rm.metricsEnv" -}}
{{- if and .Values.metrics.enabled (not .Values.metrics.host) }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- end -}}

{{- define "rm.commonEnv" -}}
- name: HOME
  value: /home/app
- name: XDG_CACHE_HOME
  value: /home/app/.cache
- name: HF_HOME
  value: /home/app/.cache/huggingface
- name: VLLM_CACHE_ROOT
  value: {{ printf "%s/vllm" .Values.caches.mountPath | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" .Values.caches.mountPath | quote }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ printf "%s/inductor" .Values.caches.mountPath | quote }}
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

{{/* One volume from {hostPath | claimName | (emptyDir, sizeLimit)}. Args: dict "name" N "spec" S ["readOnly" B] ["hostPathType" T] */}}
{{- define "rm.volume" -}}
- name: {{ .name }}
{{- if .spec.claimName }}
  persistentVolumeClaim:
    claimName: {{ .spec.claimName }}
    {{- if .readOnly }}
    readOnly: true
    {{- end }}
{{- else if .spec.hostPath }}
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

{{/* Volumes every GPU pod mounts: models and data (read-only), extra volumes, the shared compile cache. */}}
{{- define "rm.sharedVolumes" -}}
{{- $s := .Values.storage -}}
{{- if $s.models.enabled }}
{{ include "rm.volume" (dict "name" "models" "spec" $s.models "readOnly" true) }}
{{- end }}
{{- if $s.data.enabled }}
{{ include "rm.volume" (dict "name" "data" "spec" $s.data "readOnly" true) }}
{{- end }}
{{- range $s.extraVolumes }}
{{ include "rm.volume" (dict "name" .name "spec" . "readOnly" (ne .readOnly false)) }}
{{- end }}
{{ include "rm.volume" (dict "name" "compile-cache" "spec" .Values.caches) }}
{{- end -}}

{{- define "rm.sharedMounts" -}}
{{- $s := .Values.storage -}}
{{- if $s.models.enabled }}
- name: models
  mountPath: {{ $s.models.mountPath }}
  readOnly: true
{{- end }}
{{- if $s.data.enabled }}
# Rollout requests carry image paths: the servers read them from the same dataset mount.
- name: data
  mountPath: {{ $s.data.mountPath }}
  readOnly: true
{{- end }}
{{- range $s.extraVolumes }}
- name: {{ .name }}
  mountPath: {{ .mountPath }}
  readOnly: {{ ne .readOnly false }}
{{- end }}
- name: compile-cache
  mountPath: {{ .Values.caches.mountPath }}
{{- end -}}
