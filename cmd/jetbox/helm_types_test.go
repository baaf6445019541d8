package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apivalidation "k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// chartKubeVersions are the Kubernetes versions TestHelmKubeTypes renders
// the chart for: the oldest its Chart.yaml kubeVersion admits, two between,
// and the newest, whose API types (k8s.io/api) decode every object. The
// chart's README.md and docs/operations.md name them.
var chartKubeVersions = []string{"1.26.0", "1.30.0", "1.33.0", "1.37.0"}

// kubeDecoder decodes a manifest into the API type of its apiVersion and kind,
// strictly, as the API server does under fieldValidation=Strict: an unknown
// or duplicate field, a value of the wrong type or a kind it has no type for
// is an error.
func kubeDecoder(t *testing.T) runtime.Decoder {
	t.Helper()
	s := runtime.NewScheme()
	// A template of a new API group fails with "no kind is registered":
	// add the group's AddToScheme here.
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, monitoringv1.AddToScheme} {
		must(t, add(s))
	}
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
}

// manifest is one document of helm template's output.
type manifest struct {
	source string // the template, from helm's "# Source:" line
	kind   string // apiVersion and kind, as written
	doc    []byte
}

// splitManifests cuts helm template's output into its documents, dropping
// the empty ones.
func splitManifests(out []byte) ([]manifest, error) {
	r := kyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(out)))
	var ms []manifest
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return ms, nil
		}
		if err != nil {
			return nil, fmt.Errorf("split helm template output: %w", err)
		}
		var m map[string]any
		if err := yaml.Unmarshal(doc, &m); err != nil {
			return nil, fmt.Errorf("helm template output is not YAML: %w", err)
		}
		if m == nil {
			continue
		}
		src := "?"
		for _, line := range strings.Split(string(doc), "\n") {
			if s, ok := strings.CutPrefix(line, "# Source: "); ok {
				src = s
				break
			}
		}
		ms = append(ms, manifest{source: src, kind: fmt.Sprintf("%v %v", m["apiVersion"], m["kind"]), doc: doc})
	}
}

// validateObject applies the API server's own checks of names, labels,
// annotations and selectors (k8s.io/apimachinery's validation) to what the
// chart sets: the object's metadata, and the pod template's container, port,
// variable and volume names.
func validateObject(obj runtime.Object) field.ErrorList {
	m, ok := obj.(metav1.Object)
	if !ok {
		return field.ErrorList{field.InternalError(nil, fmt.Errorf("%T has no metadata", obj))}
	}
	if m.GetNamespace() == "" {
		m.SetNamespace("apps") // helm install --namespace sets it
	}
	nameFn := apivalidation.NameIsDNSSubdomain
	var errs field.ErrorList
	switch o := obj.(type) {
	case *corev1.Service:
		nameFn = apivalidation.NameIsDNS1035Label
		for i, p := range o.Spec.Ports {
			errs = append(errs, names(field.NewPath("spec", "ports").Index(i).Child("name"), p.Name, validation.IsValidPortName)...)
		}
		errs = append(errs, metav1validation.ValidateLabels(o.Spec.Selector, field.NewPath("spec", "selector"))...)
	case *appsv1.Deployment:
		errs = append(errs, metav1validation.ValidateLabelSelector(o.Spec.Selector, metav1validation.LabelSelectorValidationOptions{}, field.NewPath("spec", "selector"))...)
		errs = append(errs, validatePodTemplate(&o.Spec.Template, field.NewPath("spec", "template"))...)
	case *policyv1.PodDisruptionBudget:
		errs = append(errs, metav1validation.ValidateLabelSelector(o.Spec.Selector, metav1validation.LabelSelectorValidationOptions{}, field.NewPath("spec", "selector"))...)
	case *monitoringv1.ServiceMonitor:
		errs = append(errs, metav1validation.ValidateLabelSelector(&o.Spec.Selector, metav1validation.LabelSelectorValidationOptions{}, field.NewPath("spec", "selector"))...)
	case *monitoringv1.PodMonitor:
		errs = append(errs, metav1validation.ValidateLabelSelector(&o.Spec.Selector, metav1validation.LabelSelectorValidationOptions{}, field.NewPath("spec", "selector"))...)
	}
	return append(apivalidation.ValidateObjectMetaAccessor(m, true, nameFn, field.NewPath("metadata")), errs...)
}

func validatePodTemplate(tpl *corev1.PodTemplateSpec, p *field.Path) field.ErrorList {
	errs := metav1validation.ValidateLabels(tpl.Labels, p.Child("metadata", "labels"))
	errs = append(errs, apivalidation.ValidateAnnotations(tpl.Annotations, p.Child("metadata", "annotations"))...)
	spec := p.Child("spec")
	for i, c := range tpl.Spec.Containers {
		cp := spec.Child("containers").Index(i)
		errs = append(errs, names(cp.Child("name"), c.Name, validation.IsDNS1123Label)...)
		for j, port := range c.Ports {
			errs = append(errs, names(cp.Child("ports").Index(j).Child("name"), port.Name, validation.IsValidPortName)...)
		}
		for j, e := range c.Env {
			errs = append(errs, names(cp.Child("env").Index(j).Child("name"), e.Name, validation.IsEnvVarName)...)
		}
	}
	for i, v := range tpl.Spec.Volumes {
		errs = append(errs, names(spec.Child("volumes").Index(i).Child("name"), v.Name, validation.IsDNS1123Label)...)
	}
	return errs
}

func names(p *field.Path, value string, check func(string) []string) field.ErrorList {
	var errs field.ErrorList
	for _, msg := range check(value) {
		errs = append(errs, field.Invalid(p, value, msg))
	}
	return errs
}

// checkKubeTypes decodes every object of helm template's output into its
// API type and validates it; it returns the kinds it decoded.
func checkKubeTypes(t *testing.T, dec runtime.Decoder, out []byte) []string {
	t.Helper()
	ms, err := splitManifests(out)
	if err != nil {
		t.Fatal(err)
	}
	var kinds []string
	for _, m := range ms {
		obj, _, err := dec.Decode(m.doc, nil, nil)
		switch {
		case runtime.IsNotRegisteredError(err):
			t.Errorf("%s: %v: the test has no API type for it; add its group's AddToScheme to kubeDecoder (helm_types_test.go)", m.source, err)
			continue
		case err != nil:
			t.Errorf("%s: not a valid %s: %v", m.source, m.kind, err)
			continue
		}
		kinds = append(kinds, m.kind)
		if errs := validateObject(obj); len(errs) > 0 {
			t.Errorf("%s: the API server would refuse the %s: %v", m.source, m.kind, errs.ToAggregate())
		}
	}
	return kinds
}

// kubeVersionsPhrase is how the docs name chartKubeVersions.
func kubeVersionsPhrase() string {
	v := chartKubeVersions
	return "Kubernetes " + strings.Join(v[:len(v)-1], ", ") + " and " + v[len(v)-1]
}

// TestHelmKubeTypes renders the defaults and each ci/ variant for each of
// chartKubeVersions and decodes every object strictly into Kubernetes' own
// API types (k8s.io/api; the Prometheus Operator's for its CRDs), then
// applies the API server's name, label and selector checks. helm lint
// --strict runs for the newest version too (an API deprecated or removed by
// then fails; TestHelmChart lints for defaultKubeVersion).
func TestHelmKubeTypes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs helm (-short)")
	}
	helm := helmBin(t)
	oldest, newest := chartKubeVersions[0], chartKubeVersions[len(chartKubeVersions)-1]
	// The versions are the ones the chart admits and the types know.
	b, err := os.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	must(t, err)
	var chart struct {
		KubeVersion string `yaml:"kubeVersion"`
	}
	must(t, yaml.Unmarshal(b, &chart))
	if want := ">=" + oldest + "-0"; chart.KubeVersion != want {
		t.Errorf("Chart.yaml kubeVersion %q, chartKubeVersions starts at %s (want %q): keep them together", chart.KubeVersion, oldest, want)
	}
	major, minor, _ := strings.Cut(oldest, ".")
	minor, _, _ = strings.Cut(minor, ".")
	n, err := strconv.Atoi(minor)
	must(t, err)
	below := fmt.Sprintf("%s.%d.0", major, n-1)
	if _, err := helmRender(t, helm, below); err == nil || !strings.Contains(err.Error(), "incompatible with Kubernetes") {
		t.Errorf("--kube-version %s: %v, want the chart's kubeVersion refusal", below, err)
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range bi.Deps {
			if m.Path == "k8s.io/api" && !strings.HasPrefix(m.Version, "v0."+strings.Split(newest, ".")[1]+".") {
				t.Errorf("k8s.io/api %s is not Kubernetes %s, the newest of chartKubeVersions: update one", m.Version, newest)
			}
		}
	}
	for _, doc := range []string{filepath.Join(chartDir, "README.md"), filepath.Join(repoRoot, "docs/operations.md")} {
		b, err := os.ReadFile(doc)
		must(t, err)
		if !strings.Contains(strings.Join(strings.Fields(string(b)), " "), kubeVersionsPhrase()) {
			t.Errorf("%s does not name the checked versions (%q)", doc, kubeVersionsPhrase())
		}
	}
	dec := kubeDecoder(t)
	for _, v := range chartVariants {
		name := v.file
		if name == "" {
			name = "defaults"
		}
		var args []string
		if v.file != "" {
			args = []string{"-f", filepath.Join(chartDir, "ci", v.file)}
		}
		for _, kv := range chartKubeVersions {
			t.Run(name+"/"+kv, func(t *testing.T) {
				t.Parallel()
				out, err := helmRender(t, helm, kv, args...)
				if err != nil {
					t.Fatal(err)
				}
				kinds := checkKubeTypes(t, dec, out)
				if len(kinds) == 0 {
					t.Error("rendered no object")
				}
				if kv == newest {
					lint := exec.Command(helm, append([]string{"lint", "--strict", "--kube-version", kv, chartDir}, args...)...)
					lint.Env = helmEnv(t)
					if out, err := lint.CombinedOutput(); err != nil {
						t.Errorf("helm lint --strict --kube-version %s: %v\n%s", kv, err, out)
					}
				}
			})
		}
	}
}
