// Package kustomized renders the operator's kustomize trees (config/) with
// the kustomize Go API, as kubectl kustomize does, for the tests that apply
// them to a real apiserver and compare the Deployment with the end-to-end
// test's process.
package kustomized

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Render builds the kustomization in dir (e.g. config/default) and
// returns its objects in kustomize's order (namespaces and CRDs first).
func Render(dir string) ([]*unstructured.Unstructured, error) {
	opts := krusty.MakeDefaultOptions()
	opts.Reorder = krusty.ReorderOptionUnspecified // the kustomization's sortOptions decide, as in kubectl
	m, err := krusty.MakeKustomizer(opts).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, err
	}
	y, err := m.AsYaml()
	if err != nil {
		return nil, err
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(y), 4096)
	var out []*unstructured.Unstructured
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			return out, nil
		} else if err != nil {
			return nil, err
		}
		if obj != nil {
			out = append(out, &unstructured.Unstructured{Object: obj})
		}
	}
}

// Operator returns the operator's Deployment among objs and its container
// named "operator".
func Operator(objs []*unstructured.Unstructured) (*appsv1.Deployment, *corev1.Container, error) {
	for _, o := range objs {
		if o.GetKind() != "Deployment" {
			continue
		}
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, &d, true); err != nil {
			return nil, nil, fmt.Errorf("deployment %s: %w", o.GetName(), err)
		}
		for i := range d.Spec.Template.Spec.Containers {
			if c := &d.Spec.Template.Spec.Containers[i]; c.Name == "operator" {
				return &d, c, nil
			}
		}
		return nil, nil, fmt.Errorf("deployment %s has no container named operator", d.Name)
	}
	return nil, nil, errors.New("no deployment among the objects")
}

// Flag is the value of --name in args (given as --name=value), and
// whether it is there.
func Flag(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// ProcessFlags are the flags of the operator's Deployment whose values
// name what surrounds its pod (the entries file's path in the pod, the
// pod's namespace, the probe target, the addresses it listens on): a
// process outside a pod (the end-to-end test's) passes its own values.
var ProcessFlags = []string{"entries", "leader-election-namespace", "connect-target", "metrics-bind-address", "health-probe-bind-address"}

// ProcessArgs are the Deployment's container args for a process that runs
// outside a pod: each flag named in set gets set's value instead (they
// name what surrounds the pod: files, namespace, addresses), and add is
// appended (flags a pod has no use for, such as --kubeconfig). It fails
// when set names a flag the container does not pass, or when the
// container's args are not all --name=value.
func ProcessArgs(c *corev1.Container, set map[string]string, add ...string) ([]string, error) {
	var out []string
	used := map[string]bool{}
	for _, a := range c.Args {
		name, _, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !ok {
			return nil, fmt.Errorf("container arg %q is not --name=value", a)
		}
		if v, ok := set[name]; ok {
			a, used[name] = "--"+name+"="+v, true
		}
		out = append(out, a)
	}
	for name := range set {
		if !used[name] {
			return nil, fmt.Errorf("the Deployment passes no --%s", name)
		}
	}
	return append(out, add...), nil
}
