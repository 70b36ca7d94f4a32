{{- define "disagg-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg-operator.fullname" -}}
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

{{- define "disagg-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "disagg-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "disagg-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: disagg
{{- end }}

{{- define "disagg-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: required when serviceAccount.create is false (name an existing ServiceAccount)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}; the tag defaults to the chart's appVersion. */}}
{{- define "disagg-operator.imageRef" -}}
{{- $img := index . 0 }}{{- $root := index . 1 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default $root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{- define "disagg-operator.operatorImage" -}}
{{- include "disagg-operator.imageRef" (list .Values.image.operator .) }}
{{- end }}

{{/* The image of one child component: its own values, or the operator image when its repository is empty. */}}
{{- define "disagg-operator.componentImage" -}}
{{- $img := index . 0 }}{{- $root := index . 1 }}
{{- if $img.repository }}
{{- include "disagg-operator.imageRef" (list $img $root) }}
{{- else }}
{{- include "disagg-operator.operatorImage" $root }}
{{- end }}
{{- end }}

{{/* The one image the operator gives its router, rendezvous and plugin init container (--operator-image).
The operator takes a single image for the three, so values that resolve to different images are an error,
never silently ignored. */}}
{{- define "disagg-operator.childImage" -}}
{{- $router := include "disagg-operator.componentImage" (list .Values.image.router .) }}
{{- $rendezvous := include "disagg-operator.componentImage" (list .Values.image.rendezvous .) }}
{{- $plugin := include "disagg-operator.componentImage" (list .Values.image.pluginInit .) }}
{{- if or (ne $router $rendezvous) (ne $router $plugin) }}
{{- fail (printf "image.router (%s), image.rendezvous (%s) and image.pluginInit (%s) must resolve to the same image: the operator runs all three from one image (--operator-image). Leave their repository empty to use image.operator, or set all three alike." $router $rendezvous $plugin) }}
{{- end }}
{{- $router }}
{{- end }}

{{- define "disagg-operator.peering" -}}
{{- if or .Values.peering.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{- define "disagg-operator.peeringName" -}}
{{- default .Release.Name .Values.peering.name }}
{{- end }}

{{/*
The rules the operator needs in every namespace it serves. Each one is used by operator/ or by kopf; nothing
here deletes (owner references let the garbage collector remove children) and nothing reads Secrets. The one
delete the operator holds is on its rendezvous ClusterRoleBindings, in clusterRules below.
*/}}
{{- define "disagg-operator.namespacedRules" -}}
# DisaggregatedInference: kopf lists and watches it (the operator has no handler that needs kopf's annotations);
# the reconciler reads one before recreating a deleted child (get).
- apiGroups: ["serving.disagg.io"]
  resources: ["disaggregatedinferences"]
  verbs: ["get", "list", "watch"]
# The reconciler publishes conditions, counts and the endpoint through the status subresource.
- apiGroups: ["serving.disagg.io"]
  resources: ["disaggregatedinferences/status"]
  verbs: ["patch"]
# Children carry an owner reference with blockOwnerDeletion; clusters running the
# OwnerReferencesPermissionEnforcement admission plugin require update on the owner's finalizers for that.
- apiGroups: ["serving.disagg.io"]
  resources: ["disaggregatedinferences/finalizers"]
  verbs: ["update"]
# DisaggregatedRole, one per CR and role (<cr>-prefill, <cr>-decode), whose /scale kubectl scale, an HPA or KEDA
# write: the operator creates each one, owned by its CR (the garbage collector deletes it), reads one back when its
# create or update conflicts (get), updates its count and owner only on the resourceVersion it read (patch), and
# kopf indexes and watches them (list, watch). The operator itself never writes /scale.
- apiGroups: ["serving.disagg.io"]
  resources: ["disaggregatedroles"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The role objects' status: replicas, readyReplicas and the engine pods' selector, which /scale reports.
- apiGroups: ["serving.disagg.io"]
  resources: ["disaggregatedroles/status"]
  verbs: ["patch"]
# Children: server-side apply (patch, and create when the child does not exist yet); kopf indexes and watches
# them (list, watch) to publish status and to put back hand edits and deletions.
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch"]
# A rollout retires an older revision once it has no engines left: its engine StatefulSets and its launch
# ConfigMap (operator/rollout/actions.py). Nothing else is ever deleted.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["delete"]
# The rendezvous token Secret (spec.rendezvous.auth: token), created once per DisaggregatedInference
# (operator/reconciler.py). Create only: the operator never reads, lists or updates Secrets; pods receive the
# token through secretKeyRef.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- if .Values.rbac.tokenReview }}
# spec.rendezvous.auth: kubernetes (the default): each DisaggregatedInference's rendezvous runs as its own
# ServiceAccount, server-side applied and owned by the CR (the garbage collector removes it). Listed once per
# resync round, so the resync confirms them against the listing instead of applying each one.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "create", "patch"]
{{- end }}
# Engine pods: watched for failed preflight checks, restarts and failed scheduling (Degraded condition). Never
# written.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Events: the operator posts them on the DisaggregatedInference (Created, Updated, ApplyFailed, InvalidSpec), and
# watches the StatefulSet controller's (field selector involvedObject.kind=StatefulSet) for engine pods it fails to
# create (FailedCreate: Degraded), which StatefulSet status does not show.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["list", "watch", "create"]
# The same Events through the events.k8s.io API, which is another watch with its own field selector: the kubelet's
# FailedMount (reason=FailedMount) on engine pods, a volume it cannot mount (Degraded), which the pod's status does
# not show.
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["list", "watch"]
{{- if and (include "disagg-operator.peering" .) .Values.watchNamespaces }}
# kopf peering per watched namespace: the operator creates its KopfPeering; kopf watches it and patches its
# own liveness record into it.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "create", "patch"]
{{- end }}
{{- end }}

{{/* Rules with no namespace. */}}
{{- define "disagg-operator.clusterRules" -}}
# kopf discovers the served resources at start-up and watches CRDs to notice them being added or changed.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
# With a namespace list, kopf observes namespaces to notice the watched ones being created and deleted.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- else if include "disagg-operator.peering" . }}
# kopf peering across the cluster: the operator creates its ClusterKopfPeering; kopf watches it and patches its
# own liveness record into it.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "create", "patch"]
{{- end }}
{{- if .Values.rbac.tokenReview }}
# spec.rendezvous.auth: kubernetes (the default): the operator binds each rendezvous' ServiceAccount to
# system:auth-delegator, so that the rendezvous can verify engine pods' tokens with TokenReviews. Binding a role
# needs its permissions or `bind` on it: `bind` on that one ClusterRole, so the operator can grant nothing else
# (and sends no TokenReview itself).
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  verbs: ["bind"]
  resourceNames: ["system:auth-delegator"]
# The bindings, one per DisaggregatedInference (server-side apply: create, patch). Cluster-scoped, so no owner
# reference and no garbage collection: the operator lists the ones it labelled and deletes those whose CR is
# gone (or now uses auth token). THE ONE DELETE THE OPERATOR HOLDS. RBAC cannot limit a delete by label; the code
# deletes only bindings with its labels, its `disagg-rendezvous:` name, roleRef system:auth-delegator and a CR in
# a namespace it serves, with the UID and resourceVersion it checked as preconditions.
# rbac.tokenReview=false drops these rules (and the ServiceAccount rule): CRs must then set
# spec.rendezvous.auth: token.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterrolebindings"]
  verbs: ["list", "create", "patch", "delete"]
{{- end }}
{{- end }}
