{{- define "gearshift.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gearshift.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "gearshift.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's pod labels as k=v,k=v: each router's Admin NetworkPolicy admits them. */}}
{{- define "gearshift.selectorString" -}}
app.kubernetes.io/name={{ .Chart.Name }},app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/component=operator
{{- end -}}

{{- define "gearshift.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gearshift.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces watched when not cluster-wide: the list, or the release namespace. */}}
{{- define "gearshift.namespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- join "," .Values.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* Rules shared by the Role and the ClusterRole. */}}
{{- define "gearshift.rules" -}}
- apiGroups: ["gearshift.dev"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["gearshift.dev"]
  resources: ["inferencedeployments/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Each deployment's two token Secrets: the operator creates them, and rewrites them (a JSON
# patch that first tests their labels) when their tokens rotate. It never reads a Secret (the
# tokens derive from its key, a mounted file), never lists, watches or deletes one (owner
# references garbage-collect them). The ValidatingAdmissionPolicy (rbac.secretGuard) confines
# these writes to Secrets it labels.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.rbac.calibration }}
# spec.policy.auto.calibrate: the profiling Job and what lets it hand its profile back (a
# ServiceAccount, and a Role and RoleBinding granting it get/patch of its one ConfigMap). Created,
# and patched to add or remove a deployment as an owner; Jobs are listed (never watched) to find
# the calibrations a deployment stopped using. A failed Job is deleted, to be created again
# (GEARSHIFT_CALIBRATION_ATTEMPTS), and a calibration no deployment uses any more is deleted whole.
# The calibration guard (rbac.secretGuard) confines the writes and deletes to the calibration's
# own names and rule.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.volcano }}
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}
{{- if .Values.rbac.coscheduling }}
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- end }}
{{- end -}}

{{/* The Secret holding the operator's key (its deployments' tokens derive from it). */}}
{{- define "gearshift.keySecret" -}}
{{- default (printf "%s-key" (include "gearshift.fullname" .)) .Values.operator.keySecret -}}
{{- end -}}

{{/* A label map as k=v,k=v (sorted keys). */}}
{{- define "gearshift.labelString" -}}
{{- $out := list -}}
{{- range $k, $v := . -}}
{{- $out = append $out (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}
