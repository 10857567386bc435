{{/* Names and labels shared by every template. */}}

{{- define "sandkeep.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sandkeep.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every object; `component` is controller or agent where it applies. */}}
{{- define "sandkeep.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "sandkeep.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- /* commonLabels never replace the chart's own labels, nor the component label templates add. */}}
{{- with omit (.Values.commonLabels | default dict) "helm.sh/chart" "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/component" }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels of one component's pods: its podLabels over commonLabels, and its selector labels over both
(a value can never move a pod out of its own selector). Call with (dict "root" $ "component" "agent"). */}}
{{- define "sandkeep.podLabels" -}}
{{- $selector := include "sandkeep.selectorLabels" . | fromYaml }}
{{- $own := (index .root.Values .component).podLabels | default dict }}
{{- toYaml (merge (dict) $selector $own (.root.Values.commonLabels | default dict)) }}
{{- end }}

{{/* Selector labels of one component's pods: call with (dict "root" $ "component" "agent"). */}}
{{- define "sandkeep.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sandkeep.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* [registry/]repository, then @digest when one is set, else :tag (default: appVersion). */}}
{{- define "sandkeep.image" -}}
{{- $repository := .Values.image.repository }}
{{- with .Values.image.registry }}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* topologySpreadConstraints of one component, each without a labelSelector given that component's
selector labels. Call with (dict "root" $ "component" "agent"). */}}
{{- define "sandkeep.topologySpread" -}}
{{- $selector := include "sandkeep.selectorLabels" . | fromYaml }}
{{- $out := list }}
{{- range (index .root.Values .component).topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- define "sandkeep.leaseNamespace" -}}
{{- default .Release.Namespace .Values.leaseNamespace }}
{{- end }}

{{- define "sandkeep.controller.serviceAccountName" -}}
{{- default (printf "%s-controller" (include "sandkeep.fullname" .)) .Values.controller.serviceAccount.name }}
{{- end }}

{{- define "sandkeep.agent.serviceAccountName" -}}
{{- default (printf "%s-agent" (include "sandkeep.fullname" .)) .Values.agent.serviceAccount.name }}
{{- end }}

{{/* The cluster-wide settings as the SANDKEEP_* environment both components read (controller/models.py Settings). */}}
{{- define "sandkeep.settingsEnv" -}}
- name: SANDKEEP_RETENTION
  value: {{ .Values.settings.retention | quote }}
- name: SANDKEEP_MAX_PIN
  value: {{ .Values.settings.maxPin | quote }}
{{- range $outcome, $window := .Values.settings.retentionByOutcome }}
{{- if not (kindIs "invalid" $window) }}
- name: SANDKEEP_RETENTION_{{ upper $outcome }}
  value: {{ $window | quote }}
{{- end }}
{{- end }}
- name: SANDKEEP_MAX_RETENTION
  value: {{ .Values.settings.maxRetention | quote }}
- name: SANDKEEP_MAX_PIN_CEILING
  value: {{ .Values.settings.maxPinCeiling | quote }}
{{- if not (kindIs "invalid" .Values.settings.maxAge) }}
- name: SANDKEEP_MAX_AGE
  value: {{ .Values.settings.maxAge | quote }}
{{- end }}
- name: SANDKEEP_DRY_RUN
  value: {{ .Values.settings.dryRun | quote }}
- name: SANDKEEP_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- end }}

{{/* The agents' heartbeat Lease names are this prefix + the node (controller/contracts.py AGENT_LEASE_PREFIX). */}}
{{- define "sandkeep.agentLeasePrefix" -}}
sandkeep-agent-
{{- end }}

{{/* The agent's Localhost seccomp profile, relative to the kubelet's seccomp directory: one per release. */}}
{{- define "sandkeep.agentSeccompProfile" -}}
sandkeep/{{ include "sandkeep.agentSeccompFile" . }}
{{- end }}

{{- define "sandkeep.agentSeccompFile" -}}
{{ include "sandkeep.fullname" . }}-agent.json
{{- end }}

{{/* The image of a session that names none: always allowed. */}}
{{- define "sandkeep.sessionsImage" -}}
{{- default (include "sandkeep.image" .) .Values.sessions.image }}
{{- end }}

{{/* Every image a session may run (JSON list): the default, then sessions.allowedImages. */}}
{{- define "sandkeep.sessionsAllowedImages" -}}
{{- toJson (uniq (concat (list (include "sandkeep.sessionsImage" .)) (.Values.sessions.allowedImages | default list))) }}
{{- end }}

{{/* The CSI driver's name (controller/rules/contracts.py CSI_DRIVER): the CSIDriver object, every Pod's `csi.driver`. */}}
{{- define "sandkeep.csiDriver" -}}
csi.sandkeep.io
{{- end }}

{{/* The node plugin's socket directory on the host, under the kubelet's plugins directory. */}}
{{- define "sandkeep.csiPluginDir" -}}
{{ trimSuffix "/" .Values.csi.kubeletDir }}/plugins/{{ include "sandkeep.csiDriver" . }}
{{- end }}
