{{/*
Chart name (63 chars max, DNS label).
*/}}
{{- define "ckpt-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: "<release>-<chart>" unless the release already contains the chart name.
*/}}
{{- define "ckpt-operator.fullname" -}}
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

{{/*
"<chart>-<version>" for the helm.sh/chart label.
*/}}
{{- define "ckpt-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels (every resource, the generated CRD included).
*/}}
{{- define "ckpt-operator.labels" -}}
helm.sh/chart: {{ include "ckpt-operator.chart" . }}
{{ include "ckpt-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ckpt-operator
{{- end }}

{{/*
Selector labels (immutable: the Deployment selector and the Services).
*/}}
{{- define "ckpt-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ckpt-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The operator's ServiceAccount name.
*/}}
{{- define "ckpt-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ckpt-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Operator image reference (digest wins over tag; tag defaults to appVersion).
*/}}
{{- define "ckpt-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Agent (sidecar) image reference.
*/}}
{{- define "ckpt-operator.agentImage" -}}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) }}
{{- end }}

{{- define "ckpt-operator.webhookServiceName" -}}
{{- printf "%s-webhook" (include "ckpt-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ckpt-operator.metricsServiceName" -}}
{{- printf "%s-metrics" (include "ckpt-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Name of the Secret holding the webhook's serving certificate.
*/}}
{{- define "ckpt-operator.webhookCertSecret" -}}
{{- if eq .Values.webhook.certificate.source "secret" }}
{{- required "webhook.certificate.secret.name is required when webhook.certificate.source is secret" .Values.webhook.certificate.secret.name }}
{{- else }}
{{- printf "%s-webhook-tls" (include "ckpt-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Webhook certificates for source=helm, generated once per render and shared by the Secret
and both webhook configurations. An existing Secret (a previous install) is reused, so
upgrades do not rotate the CA under running API servers. Returns YAML: ca, crt, key (base64).
*/}}
{{- define "ckpt-operator.helmCerts" -}}
{{- $cache := .Values._generatedWebhookCerts | default dict }}
{{- if not $cache.ca }}
{{- $secretName := include "ckpt-operator.webhookCertSecret" . }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $secretName }}
{{- if and $existing $existing.data (index $existing.data "ca.crt") }}
{{- $_ := set $cache "ca" (index $existing.data "ca.crt") }}
{{- $_ := set $cache "crt" (index $existing.data "tls.crt") }}
{{- $_ := set $cache "key" (index $existing.data "tls.key") }}
{{- else }}
{{- $svc := include "ckpt-operator.webhookServiceName" . }}
{{- $ns := .Release.Namespace }}
{{- $days := int .Values.webhook.certificate.helm.validityDays }}
{{- $ca := genCA (printf "%s-webhook-ca" (include "ckpt-operator.fullname" .)) $days }}
{{- $dns := list (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) (printf "%s.%s" $svc $ns) $svc }}
{{- $ips := list }}
{{- with .Values.webhook.url }}
{{- $host := (urlParse .).hostname }}
{{- if or (regexMatch "^[0-9.]+$" $host) (contains ":" $host) }}
{{- $ips = append $ips $host }}
{{- else if $host }}
{{- $dns = append $dns $host }}
{{- end }}
{{- end }}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc $ns) $ips $dns $days $ca }}
{{- $_ := set $cache "ca" ($ca.Cert | b64enc) }}
{{- $_ := set $cache "crt" ($cert.Cert | b64enc) }}
{{- $_ := set $cache "key" ($cert.Key | b64enc) }}
{{- end }}
{{- $_ := set .Values "_generatedWebhookCerts" $cache }}
{{- end }}
{{- toYaml $cache }}
{{- end }}

{{/*
caBundle for the webhook configurations (empty for cert-manager: its CA injector fills it).
*/}}
{{- define "ckpt-operator.caBundle" -}}
{{- if eq .Values.webhook.certificate.source "helm" }}
{{- (include "ckpt-operator.helmCerts" . | fromYaml).ca }}
{{- else if eq .Values.webhook.certificate.source "secret" }}
{{- required "webhook.certificate.secret.caBundle is required when webhook.certificate.source is secret" .Values.webhook.certificate.secret.caBundle }}
{{- end }}
{{- end }}

{{/*
Annotations of the webhook configurations (cert-manager CA injection).
*/}}
{{- define "ckpt-operator.webhookAnnotations" -}}
{{- if eq .Values.webhook.certificate.source "certManager" }}
cert-manager.io/inject-ca-from: {{ printf "%s/%s-webhook" .Release.Namespace (include "ckpt-operator.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The ckpt.dev annotations the job webhooks check, as a CEL list: exactly the keys
ckpt_operator.planners.validation.CHECKED_ANNOTATIONS (tests/ckpt_operator/test_chart.py checks it).
*/}}
{{- define "ckpt-operator.checkedAnnotations" -}}
['ckpt.dev/run-id', 'ckpt.dev/resume-from', 'ckpt.dev/resume-weights', 'ckpt.dev/resume-step', 'ckpt.dev/restart-count', 'ckpt.dev/run-started-at', 'ckpt.dev/mtbf-seconds', 'ckpt.dev/recover-step', 'ckpt.dev/recover-force', 'ckpt.dev/recover-dry-run', 'ckpt.dev/recover-by', 'ckpt.dev/recover-reason']
{{- end }}

{{/*
matchConditions of the job validation webhooks: the API server calls them only when a
checked annotation is present and new (a CREATE, or absent or different in the old
object), the only case ckpt_operator.planners.validation.annotation_errors can object to. Every
other write (the operator's own PATCHes, the training-operator's updates) skips the call.
The rules match CREATE and UPDATE only, so oldObject is null only on a CREATE, which the
first term decides; an object without annotations never calls (nothing to check). No
term can fail to evaluate: an error would skip the call (or, with failurePolicy Fail,
refuse the write).
*/}}
{{- define "ckpt-operator.jobValidationConditions" -}}
- name: checked-annotation-changed
  expression: >-
    has(object.metadata.annotations) &&
    {{ include "ckpt-operator.checkedAnnotations" . }}.exists(k,
    k in object.metadata.annotations &&
    (request.operation == 'CREATE' || !has(oldObject.metadata.annotations) ||
    !(k in oldObject.metadata.annotations) ||
    oldObject.metadata.annotations[k] != object.metadata.annotations[k]))
{{- end }}
