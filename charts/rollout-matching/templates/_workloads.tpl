{{/*
The pod templates and Job specs: the ONE source of the pod spec (args, env, volumes, probes, security, GPU
assignment). The chart's Jobs / JobSet and `python -m trainer render-job` (which renders this chart with Helm and
only wraps the Jobs) both use them.
*/}}

{{/* Rollout-server pod template. Args: dict "root" $ "index" i "inst" instance */}}
{{- define "rm.serverPod" -}}
{{- $root := .root -}}
{{- $i := .index -}}
{{- $inst := .inst -}}
{{- $srv := $root.Values.rolloutServer -}}
{{- $lp := fromYaml (include "rm.learnerPorts" $root) -}}
metadata:
  labels:
    {{- include "rm.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: rollout-server
    rollout-matching/server-index: {{ $i | quote }}
  annotations:
    rollout-matching/node-gpus: {{ join "," $inst.gpus | quote }}
    {{- include "rm.portAnnotation" (dict "root" $root "index" $i) | nindent 4 }}
spec:
  {{- include "rm.scheduling" $root | nindent 2 }}
  # A crashed server restarts in place (same node, port and GPUs); the learner re-admits it.
  restartPolicy: OnFailure
  terminationGracePeriodSeconds: 60
  containers:
    - name: rollout-server
      image: {{ include "rm.image" $root.Values.images.rolloutServer }}
      imagePullPolicy: {{ $root.Values.images.rolloutServer.pullPolicy }}
      args:
        {{- if $root.Values.lifecycle.enabled }}
        # Stops the server (exit 0: the Job completes, the GPUs are released) when the learner finishes.
        - supervise
        - server
        - --learner-control
        - {{ printf "http://127.0.0.1:%v" $lp.control | quote }}
        - --poll-s
        - {{ $root.Values.lifecycle.pollIntervalS | quote }}
        - --orphan-timeout-s
        - {{ $root.Values.lifecycle.orphanTimeoutS | quote }}
        - --
        {{- end }}
        - launch
        - server
        - --engine
        - {{ $srv.engine | quote }}
        - --host
        - {{ $srv.host | quote }}
        - --port
        - {{ $inst.port | quote }}
        - --gpus
        - {{ include "rm.localDevices" $inst.gpus | quote }}
        {{- if $srv.model }}
        - --model
        - {{ $srv.model | quote }}
        {{- end }}
        - --tensor-parallel-size
        - {{ $srv.tensorParallelSize | quote }}
        - --data-parallel-size
        - {{ $srv.dataParallelSize | quote }}
        {{- if not (kindIs "invalid" $srv.gpuMemoryUtilization) }}
        - --gpu-memory-utilization
        - {{ $srv.gpuMemoryUtilization | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $srv.maxModelLen) }}
        - --max-model-len
        - {{ $srv.maxModelLen | quote }}
        {{- end }}
        {{- if include "rm.isGrpo" $root }}
        # GRPO: swift rollout also takes model_type, template and the other custom.extra.rollout_server knobs.
        - --config
        - /etc/rollout-matching/train.yaml
        {{- end }}
        {{- if $srv.enableLora }}
        - --enable-lora
        {{- end }}
        {{- range $srv.extraArgs }}
        - {{ . | quote }}
        {{- end }}
        {{- if include "rm.serverMetrics" $root }}
        {{- if not (has "--" $srv.extraArgs) }}
        - "--"
        {{- end }}
        # Prometheus metrics (metrics.enabled): GET /metrics without the API key on a second port.
        - --metrics-port
        - {{ add (int $inst.port) (int $root.Values.metrics.serverPortOffset) | quote }}
        - --metrics-host
        - {{ include "rm.metricsHost" $root | quote }}
        {{- end }}
      env:
        {{- include "rm.commonEnv" $root | nindent 8 }}
        {{- include "rm.metricsEnv" $root | nindent 8 }}
        {{- include "rm.portEnv" (dict "root" $root "index" $i "role" "server") | trim | nindent 8 }}
        {{- include "rm.gpuEnv" (dict "root" $root "gpus" $inst.gpus) | nindent 8 }}
      {{- include "rm.resources" (dict "root" $root "gpus" $inst.gpus "resources" $srv.resources) | nindent 6 }}
      {{- include "rm.containerSecurityContext" $root | nindent 6 }}
      # The server listens on the node's loopback only, so the kubelet probes 127.0.0.1 (host network).
      startupProbe:
        httpGet:
          host: 127.0.0.1
          path: /health/
          port: {{ $inst.port }}
        {{- toYaml $srv.probes.startup | nindent 8 }}
      readinessProbe:
        httpGet:
          host: 127.0.0.1
          path: /health/
          port: {{ $inst.port }}
        {{- toYaml $srv.probes.readiness | nindent 8 }}
      volumeMounts:
        {{- include "rm.scratchMounts" $root | nindent 8 }}
        {{- include "rm.sharedMounts" $root | trim | nindent 8 }}
        {{- if include "rm.isGrpo" $root }}
        - name: config
          mountPath: /etc/rollout-matching
          readOnly: true
        {{- end }}
  volumes:
    {{- include "rm.scratchVolumes" $srv | nindent 4 }}
    {{- include "rm.sharedVolumes" $root | trim | nindent 4 }}
    {{- if include "rm.isGrpo" $root }}
    - name: config
      configMap:
        name: {{ include "rm.fullname" $root }}-config
    {{- end }}
{{- end -}}

{{/* Learner pod template. Arg: $ */}}
{{- define "rm.learnerPod" -}}
{{- $l := .Values.learner -}}
{{- $urls := include "rm.serverUrls" . -}}
{{- $n := len .Values.rolloutServer.instances -}}
{{- $lp := fromYaml (include "rm.learnerPorts" .) -}}
metadata:
  labels:
    {{- include "rm.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: learner
  annotations:
    rollout-matching/node-gpus: {{ join "," $l.gpus | quote }}
    {{- include "rm.portAnnotation" (dict "root" . "index" $n) | nindent 4 }}
    checksum/config: {{ include "rm.trainConfig" . | sha256sum }}
spec:
  {{- include "rm.scheduling" . | nindent 2 }}
  restartPolicy: Never
  containers:
    - name: learner
      image: {{ include "rm.image" .Values.images.learner }}
      imagePullPolicy: {{ .Values.images.learner.pullPolicy }}
      # Relative paths in the training config (e.g. training.output_dir: runs/x) land on the output volume.
      workingDir: {{ .Values.storage.output.mountPath }}
      args:
        {{- if and .Values.lifecycle.enabled $n }}
        # Publishes the learner's state on the lifecycle control port; the servers stop when it is final.
        - supervise
        - learner
        - --control-port
        - {{ $lp.control | quote }}
        {{- if eq (int $l.backoffLimit) 0 }}
        - --final-on-failure
        {{- end }}
        - --expect-watchers
        - {{ $n | quote }}
        - --linger-s
        - {{ mul 4 .Values.lifecycle.pollIntervalS | quote }}
        - --
        {{- end }}
        - launch
        - learner
        - --config
        - /etc/rollout-matching/train.yaml
        - --nproc-per-node
        - {{ $l.nprocPerNode | quote }}
        - --gpus
        - {{ include "rm.localDevices" $l.gpus | quote }}
        {{- if $urls }}
        - --wait-for-servers
        - {{ $urls | quote }}
        - --health-timeout-s
        - {{ $l.healthTimeoutS | quote }}
        {{- end }}
        {{- if and (eq $l.resume "auto") (not (include "rm.isGrpo" .)) }}
        # A restarted pod resumes stage 2 from the newest complete checkpoint in training.output_dir.
        - --resume
        - auto
        {{- end }}
        {{- range $l.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- include "rm.commonEnv" . | nindent 8 }}
        {{- include "rm.metricsEnv" . | nindent 8 }}
        {{- include "rm.portEnv" (dict "root" . "index" $n "role" "learner") | trim | nindent 8 }}
        {{- include "rm.gpuEnv" (dict "root" . "gpus" $l.gpus) | nindent 8 }}
      {{- include "rm.resources" (dict "root" . "gpus" $l.gpus "resources" $l.resources) | nindent 6 }}
      {{- include "rm.containerSecurityContext" . | nindent 6 }}
      volumeMounts:
        {{- include "rm.scratchMounts" . | nindent 8 }}
        - name: config
          mountPath: /etc/rollout-matching
          readOnly: true
        {{- include "rm.sharedMounts" . | trim | nindent 8 }}
        - name: output
          mountPath: {{ .Values.storage.output.mountPath }}
  volumes:
    {{- include "rm.scratchVolumes" $l | nindent 4 }}
    - name: config
      configMap:
        name: {{ include "rm.fullname" . }}-config
    {{- include "rm.sharedVolumes" . | trim | nindent 4 }}
    {{- include "rm.volume" (dict "name" "output" "spec" .Values.storage.output "hostPathType" "Directory") | nindent 4 }}
{{- end -}}

{{/* Job spec around a pod template. Args: dict "root" $ "backoffLimit" N "activeDeadlineSeconds" N|nil "pod" YAML */}}
{{- define "rm.jobSpec" -}}
{{- $v := .root.Values -}}
backoffLimit: {{ .backoffLimit }}
{{- with .activeDeadlineSeconds }}
activeDeadlineSeconds: {{ . }}
{{- end }}
{{- if not (kindIs "invalid" $v.jobs.ttlSecondsAfterFinished) }}
ttlSecondsAfterFinished: {{ $v.jobs.ttlSecondsAfterFinished }}
{{- end }}
{{- if and $v.gang.queueName (not $v.gang.jobSet.enabled) }}
# Kueue resumes the Job once its queue admits it.
suspend: true
{{- end }}
template:
  {{- .pod | nindent 2 }}
{{- end -}}

{{- define "rm.serverJobSpec" -}}
{{- $srv := .root.Values.rolloutServer -}}
{{- include "rm.jobSpec" (dict "root" .root "backoffLimit" $srv.backoffLimit "activeDeadlineSeconds" .root.Values.learner.activeDeadlineSeconds "pod" (include "rm.serverPod" .)) -}}
{{- end -}}

{{- define "rm.learnerJobSpec" -}}
{{- $l := .Values.learner -}}
{{- include "rm.jobSpec" (dict "root" . "backoffLimit" $l.backoffLimit "activeDeadlineSeconds" $l.activeDeadlineSeconds "pod" (include "rm.learnerPod" .)) -}}
{{- end -}}

{{/* Job metadata labels. Args: dict "root" $ "component" C */}}
{{- define "rm.jobLabels" -}}
{{ include "rm.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- if and .root.Values.gang.queueName (not .root.Values.gang.jobSet.enabled) }}
kueue.x-k8s.io/queue-name: {{ .root.Values.gang.queueName }}
{{- end }}
{{- end -}}
