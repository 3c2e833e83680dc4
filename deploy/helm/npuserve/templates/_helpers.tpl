{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "npuserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: the release name, with the chart name unless it already contains it. */}}
{{- define "npuserve.fullname" -}}
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

{{- define "npuserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the chart. */}}
{{- define "npuserve.labels" -}}
helm.sh/chart: {{ include "npuserve.chart" . }}
{{ include "npuserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: npuserve
{{- end }}

{{/* Labels that select the operator pod. */}}
{{- define "npuserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "npuserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "npuserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "npuserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "npuserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
The labels operator/render.py puts on every engine pod and Service (labels() there); the PodMonitor/ServiceMonitor
selects by them. `app.kubernetes.io/managed-by: npuserve-operator` keeps other charts' pods out.
*/}}
{{- define "npuserve.engineSelectorLabels" -}}
app.kubernetes.io/name: npuserve-engine
app.kubernetes.io/component: engine
app.kubernetes.io/managed-by: npuserve-operator
{{- end }}

{{/* The operator's command line: `npuserve operator` and the flags from the values. */}}
{{- define "npuserve.operatorArgs" -}}
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace
- {{ . | quote }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- with .Values.prometheus.url }}
- --prometheus-url
- {{ . | quote }}
{{- end }}
- --log-level
- {{ .Values.logLevel | quote }}
- --liveness-endpoint
- {{ printf "http://0.0.0.0:%d/healthz" (int .Values.livenessProbe.port) | quote }}
{{- if .Values.leaderElection.enabled }}
- --leader-elect
- --leader-election-id
- {{ include "npuserve.leaseName" . | quote }}
- --leader-election-namespace
- {{ .Release.Namespace | quote }}
{{- end }}
{{- end }}

{{/* The leader-election Lease: one per release, in the release namespace. */}}
{{- define "npuserve.leaseName" -}}
{{- include "npuserve.fullname" . }}
{{- end }}

{{/*
RBAC rules, split by where they can be granted. Cluster-scoped resources (kopf's namespace scanning and CRD
discovery) always need a ClusterRole; the namespaced ones go into a ClusterRole when every namespace is watched,
or into a Role in each watched namespace.
*/}}
{{- define "npuserve.clusterScopedRules" -}}
# kopf: namespace scanning
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
# kopf: resource discovery
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
# autotune: the replicas the nodes' allocatable accelerators (or CPUs) hold, bounding the measured capacity's count
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- end }}

{{- define "npuserve.namespacedRules" -}}
# The InferenceServices: handlers, kopf's progress annotations, status
- apiGroups: [npuserve.io]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [npuserve.io]
  resources: [inferenceservices/status]
  verbs: [get, patch, update]
# What operator/render.py makes, applied server-side with owner references
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, update, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, list, watch, create, update, patch, delete]
# autotune: the scale subresource (replicas from the measured capacity)
- apiGroups: [npuserve.io]
  resources: [inferenceservices/scale]
  verbs: [get, patch, update]
# autotune: the engines' admin token (made once), read to PUT /admin/schedule
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# autotune, benchmark mode: a load-generator Job per trial (listed to delete one a dead leader left behind)
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, create, delete]
# Engine pods: their IPs, to read each engine's /info
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Kubernetes events posted by kopf and the handlers
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
