{{/*
The objects' names are fixed, not derived from the release name: the agents
find their DaemonSet as rlagent (rlagent run --agent-daemonset), elect the
status writer with the Lease rlagent-status, and the admission policies name
the ServiceAccount rlagent; the ClusterRoles and policies are cluster-wide.
So a cluster holds one release of this chart, in the namespace of its choice
(.Release.Namespace, rlagent-system in deploy/).
*/}}

{{/* The labels of every object. */}}
{{- define "rlagent.labels" -}}
app.kubernetes.io/name: rlagent
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/*
The DaemonSet's selector: what deploy/ has always selected, so that an
install made with kubectl apply -k can be upgraded (a selector is
immutable). A Service selecting the agents uses these too.
*/}}
{{- define "rlagent.selectorLabels" -}}
app.kubernetes.io/name: rlagent
app.kubernetes.io/component: agent
{{- end }}

{{/* The ServiceAccount's user name, as the admission policies match it. */}}
{{- define "rlagent.user" -}}
system:serviceaccount:{{ .Release.Namespace }}:rlagent
{{- end }}

{{/* The image: by digest when image.digest is set. */}}
{{- define "rlagent.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end }}

{{/* Where the secure metrics' certificate Secret is mounted (certDir). */}}
{{- define "rlagent.certDir" -}}
/etc/rlagent-tls
{{- end }}

{{/*
Checks of what the schema cannot say: values that must differ or go
together. Included by the ConfigMap, so that every rendering runs them.
*/}}
{{- define "rlagent.check" -}}
{{- if and .Values.metrics.secure.enabled (eq (int .Values.metrics.secure.port) (int .Values.metrics.port)) -}}
{{- fail (printf "metrics.secure.port: %v is metrics.port's; the two listeners need two ports" .Values.metrics.secure.port) -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.secure.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled: needs metrics.secure.enabled: the plain listener (metrics.port) serves 127.0.0.1 only, where Prometheus cannot scrape it" -}}
{{- end -}}
{{- if and .Values.metrics.secure.certSecret (not .Values.metrics.secure.enabled) -}}
{{- fail "metrics.secure.certSecret: set, but metrics.secure.enabled is false" -}}
{{- end -}}
{{- range $k := list "interfaces" "xdpFallback" "endpointHook" "endpointSourceCheck" "protect" "demandShares" "maxBuckets" "pinDir" "metricsAddress" "secureMetrics" "limits" -}}
{{- if hasKey $.Values.config.extra $k -}}
{{- fail (printf "config.extra.%s: the chart writes %s itself (%s)" $k $k (get (dict "pinDir" "the DaemonSet mounts the pin directory there" "metricsAddress" "from metrics.port" "secureMetrics" "from metrics.secure" "limits" "in a cluster the limits are RateLimit objects") $k | default (printf "set config.%s" $k))) -}}
{{- end -}}
{{- end -}}
{{- end }}
