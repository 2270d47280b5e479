{{/* The labels deploy/ puts on an object named for `name`, with Helm's own. */}}
{{- define "sidestep.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: sidestep
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
global.platform's host paths (istio/cni's files/profile-platform-*.yaml where Istio has one;
kind uses the defaults). An unknown platform fails the render.
*/}}
{{- define "sidestep.preset" -}}
{{- $presets := dict
  "" (dict)
  "kind" (dict "cniBinDir" "/opt/cni/bin" "cniConfDir" "/etc/cni/net.d")
  "k3s" (dict "cniBinDir" "/var/lib/rancher/k3s/data/cni" "cniConfDir" "/var/lib/rancher/k3s/agent/etc/cni/net.d")
  "gke" (dict "cniBinDir" "/home/kubernetes/bin" "cniConfDir" "/etc/cni/net.d" "resourceQuotas" true)
  "openshift" (dict "cniBinDir" "/var/lib/cni/bin" "cniConfDir" "/etc/kubernetes/cni/net.d" "seLinuxType" "spc_t")
-}}
{{- $platform := (.Values.global).platform | default "" -}}
{{- if not (hasKey $presets $platform) -}}
{{- fail (printf "global.platform %q: want one of k3s, kind, gke, openshift (or empty)" $platform) -}}
{{- end -}}
{{- get $presets $platform | toJson -}}
{{- end -}}

{{- define "sidestep.cniBinDir" -}}
{{- $preset := include "sidestep.preset" . | fromJson -}}
{{- coalesce .Values.cniBinDir $preset.cniBinDir "/opt/cni/bin" -}}
{{- end -}}

{{- define "sidestep.cniConfDir" -}}
{{- $preset := include "sidestep.preset" . | fromJson -}}
{{- coalesce .Values.cniConfDir $preset.cniConfDir "/etc/cni/net.d" -}}
{{- end -}}

{{- define "sidestep.image" -}}
{{- if contains "/" .Values.image -}}
{{- .Values.image -}}
{{- else -}}
{{- printf "%s/%s:%s" .Values.hub .Values.image (toString .Values.tag) -}}
{{- end -}}
{{- end -}}

{{/* istio/cni's three repair switches as the agent's repair-mode. */}}
{{- define "sidestep.repairMode" -}}
{{- if and .Values.repair.deletePods .Values.repair.labelPods -}}
{{- fail "repair.deletePods and repair.labelPods exclude each other" -}}
{{- else if .Values.repair.deletePods -}}
delete
{{- else if .Values.repair.labelPods -}}
label
{{- else -}}
repair
{{- end -}}
{{- end -}}

{{/* The agent's listen port, from `config.listen` if set (":9964" otherwise). */}}
{{- define "sidestep.port" -}}
{{- (get .Values.config "listen") | default ":9964" | toString | splitList ":" | last -}}
{{- end -}}
