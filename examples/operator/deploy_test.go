package operator_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/egressproxy/egressproxy/examples/operator/internal/kustomized"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
)

// warnings collects the apiserver's warnings (Warning headers).
type warnings struct {
	mu   sync.Mutex
	msgs []string
}

func (w *warnings) HandleWarningHeader(code int, agent, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.msgs = append(w.msgs, text)
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	m := w.msgs
	w.msgs = nil
	return m
}

// TestDeployApply applies config/default, as kubectl kustomize renders it,
// to a real kube-apiserver (envtest, binaries from scripts/kubestack):
// every object first with a server-side dry run (accepted, nothing
// stored), then for real. The apiserver accepts the CRD (and establishes
// it), the RBAC and the Deployment, and warns about nothing: the
// namespace asks for warnings about pod templates that break the
// restricted Pod Security Standard, and a template that runs as root does
// get one. The service account may do what the operator does. No kubelet
// or controller manager runs here: the Deployment is stored, no pod
// starts.
func TestDeployApply(t *testing.T) {
	assets := controlPlaneAssets(t)
	logf.SetLogger(logr.Discard())
	objs, err := kustomized.Render(filepath.Join("config", "default"))
	if err != nil {
		t.Fatal(err)
	}
	env := newEnvironment(assets)
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("control plane: %v", err)
	}
	t.Cleanup(func() {
		if err := env.Stop(); err != nil {
			t.Errorf("stopping the control plane: %v", err)
		}
	})
	warned := &warnings{}
	cfg = rest.CopyConfig(cfg)
	cfg.WarningHandler = warned
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	if err := apiextensionsv1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	owner := client.FieldOwner("egressproxy-deploy-test")
	kinds := map[string]int{}
	for _, o := range objs {
		what := o.GetKind() + " " + o.GetName()
		if err := c.Apply(ctx, client.ApplyConfigurationFromUnstructured(o.DeepCopy()), owner, client.ForceOwnership, client.DryRunAll); err != nil {
			t.Fatalf("server-side dry run of %s: %v", what, err)
		}
		if err := c.Get(ctx, client.ObjectKeyFromObject(o), o.DeepCopy()); !apierrors.IsNotFound(err) {
			t.Fatalf("%s after its dry run: %v, want NotFound (a dry run stores nothing)", what, err)
		}
		if err := c.Apply(ctx, client.ApplyConfigurationFromUnstructured(o.DeepCopy()), owner, client.ForceOwnership); err != nil {
			t.Fatalf("apply %s: %v", what, err)
		}
		if w := warned.take(); len(w) > 0 {
			t.Errorf("the apiserver warns about %s: %s", what, strings.Join(w, "; "))
		}
		kinds[o.GetKind()]++
	}
	for kind, n := range map[string]int{"Namespace": 1, "CustomResourceDefinition": 3, "ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "ConfigMap": 1, "Deployment": 1} {
		if kinds[kind] != n {
			t.Errorf("config/default has %d %s, want %d", kinds[kind], kind, n)
		}
	}

	// The CRDs are established: EgressProxy, EgressProxyHost and
	// EgressProxyPool objects can be created.
	for _, name := range []string{"egressproxies.egressproxy.dev", "egressproxyhosts.egressproxy.dev", "egressproxypools.egressproxy.dev"} {
		eventually.NoError(t, time.Minute, func() error {
			var crd apiextensionsv1.CustomResourceDefinition
			if err := c.Get(ctx, client.ObjectKey{Name: name}, &crd); err != nil {
				return err
			}
			for _, cond := range crd.Status.Conditions {
				if cond.Type == apiextensionsv1.Established && cond.Status == apiextensionsv1.ConditionTrue {
					return nil
				}
			}
			return fmt.Errorf("conditions %+v", crd.Status.Conditions)
		}, "the CRD %s established", name)
	}

	// The Deployment is stored as written: two replicas, its pod template
	// defaulted by the apiserver.
	_, want, err := kustomized.Operator(objs)
	if err != nil {
		t.Fatal(err)
	}
	var dep appsv1.Deployment
	if err := c.Get(ctx, client.ObjectKey{Namespace: "egressproxy-system", Name: "egressproxy-operator"}, &dep); err != nil {
		t.Fatal(err)
	}
	if got := dep.Spec.Template.Spec.Containers[0]; *dep.Spec.Replicas != 2 || got.Image != want.Image || strings.Join(got.Args, " ") != strings.Join(want.Args, " ") {
		t.Errorf("stored Deployment: %d replicas, image %s, args %q", *dep.Spec.Replicas, got.Image, got.Args)
	}

	// The namespace's warn level has teeth: a template running as root
	// gets a warning.
	var root *unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == "Deployment" {
			root = o.DeepCopy()
		}
	}
	root.SetName("runs-as-root")
	if err := unstructured.SetNestedField(root.Object, false, "spec", "template", "spec", "securityContext", "runAsNonRoot"); err != nil {
		t.Fatal(err)
	}
	if err := c.Apply(ctx, client.ApplyConfigurationFromUnstructured(root), owner, client.DryRunAll); err != nil {
		t.Fatal(err)
	}
	if w := warned.take(); len(w) == 0 || !strings.Contains(strings.Join(w, " "), "restricted") {
		t.Errorf("a template with runAsNonRoot false: warnings %q, want the restricted profile's", w)
	}

	// The operator's service account may do what the operator does.
	sa := "system:serviceaccount:egressproxy-system:egressproxy-operator"
	for _, ra := range []authorizationv1.ResourceAttributes{
		{Group: "egressproxy.dev", Resource: "egressproxies", Verb: "watch"},
		{Group: "egressproxy.dev", Resource: "egressproxies", Verb: "patch", Namespace: "team-a"},
		{Group: "egressproxy.dev", Resource: "egressproxies", Subresource: "status", Verb: "update", Namespace: "team-a"},
		{Group: "egressproxy.dev", Resource: "egressproxies", Subresource: "finalizers", Verb: "update", Namespace: "team-a"},
		{Resource: "secrets", Verb: "get", Namespace: "egressproxy-system"},
		{Resource: "events", Verb: "create", Namespace: "team-a"},
		{Group: "coordination.k8s.io", Resource: "leases", Verb: "update", Namespace: "egressproxy-system"},
		{Group: "egressproxy.dev", Resource: "egressproxyhosts", Verb: "create"},
		{Group: "egressproxy.dev", Resource: "egressproxyhosts", Verb: "delete"},
		{Group: "egressproxy.dev", Resource: "egressproxyhosts", Subresource: "status", Verb: "update"},
		{Group: "egressproxy.dev", Resource: "egressproxypools", Verb: "watch"},
		{Group: "egressproxy.dev", Resource: "egressproxypools", Subresource: "status", Verb: "patch", Namespace: "team-a"},
		{Group: "egressproxy.dev", Resource: "egressproxypools", Subresource: "finalizers", Verb: "update", Namespace: "team-a"},
		{Group: "egressproxy.dev", Resource: "egressproxies", Verb: "create", Namespace: "team-a"},
		{Group: "egressproxy.dev", Resource: "egressproxies", Verb: "delete", Namespace: "team-a"},
		{Resource: "services", Verb: "create", Namespace: "team-a"},
		{Resource: "services", Verb: "update", Namespace: "team-a"},
		{Group: "discovery.k8s.io", Resource: "endpointslices", Verb: "list", Namespace: "team-a"},
		{Group: "discovery.k8s.io", Resource: "endpointslices", Verb: "update", Namespace: "team-a"},
	} {
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: sa, ResourceAttributes: &ra}}
		if err := c.Create(ctx, sar); err != nil {
			t.Fatal(err)
		}
		if !sar.Status.Allowed {
			t.Errorf("%s may not %s %s/%s %s: %s", sa, ra.Verb, ra.Resource, ra.Subresource, ra.Namespace, sar.Status.Reason)
		}
	}
	sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: sa,
		ResourceAttributes: &authorizationv1.ResourceAttributes{Resource: "secrets", Verb: "list", Namespace: "egressproxy-system"}}}
	if err := c.Create(ctx, sar); err != nil {
		t.Fatal(err)
	}
	if sar.Status.Allowed {
		t.Errorf("%s may list secrets: the operator reads only the ones it is told", sa)
	}
}
