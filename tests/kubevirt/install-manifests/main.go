// install-manifests prints, as multi-document YAML, what KubeVirt's virt-operator would install
// for a KubeVirt CR in -namespace: the same install strategy virt-operator's
// --dump-install-strategy stores in a ConfigMap (install.NewInstallStrategyConfigMap, decoded
// here), plus the kubevirts.kubevirt.io CRD that the operator's own manifest carries. -kinds keeps
// only the listed kinds (default: what the test bed applies); -kinds all keeps everything.
//
// It is built by tests/scripts/kubevirt.sh inside a wrapper module next to kubevirt.io/kubevirt at
// the version being tested, so the output always matches the virt-api/virt-controller beside it.
package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	virtv1 "kubevirt.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/install"
	"kubevirt.io/kubevirt/pkg/virt-operator/util"
)

const defaultKinds = "CustomResourceDefinition,ValidatingWebhookConfiguration," +
	"MutatingWebhookConfiguration,APIService,ClusterRole,ClusterRoleBinding,Role,RoleBinding," +
	"ServiceAccount,ValidatingAdmissionPolicy,ValidatingAdmissionPolicyBinding"

var groupOf = map[string]string{
	"ValidatingAdmissionPolicy":        "admissionregistration.k8s.io",
	"ValidatingAdmissionPolicyBinding": "admissionregistration.k8s.io",
}

func main() {
	namespace := flag.String("namespace", "kubevirt", "namespace of the KubeVirt CR and its components")
	registry := flag.String("registry", "quay.io/kubevirt", "image registry written into Deployments")
	tag := flag.String("tag", "latest", "image tag written into Deployments")
	kinds := flag.String("kinds", defaultKinds, "comma-separated kinds to print, or all")
	flag.Parse()

	kv := &virtv1.KubeVirt{ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: *namespace}}
	kv.Spec.ImageRegistry = *registry
	kv.Spec.ImageTag = *tag
	config := util.GetTargetConfigFromKV(kv)

	// No monitoring namespace: no ServiceMonitor, PrometheusRule or their RBAC.
	cm, err := install.NewInstallStrategyConfigMap(config, "", *namespace)
	if err != nil {
		fail(err)
	}
	manifests, err := decode(cm.Data["manifests"])
	if err != nil {
		fail(err)
	}
	kvCrd, err := components.NewKubeVirtCrd()
	if err != nil {
		fail(err)
	}
	b, err := yaml.Marshal(kvCrd)
	if err != nil {
		fail(err)
	}
	manifests = "---\n" + string(b) + manifests

	keep := map[string]bool{}
	for _, k := range strings.Split(*kinds, ",") {
		keep[strings.TrimSpace(k)] = true
	}
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for _, doc := range strings.Split(manifests, "\n---\n") {
		doc = strings.TrimPrefix(strings.TrimSpace(doc), "---\n")
		if doc == "" || doc == "---" {
			continue
		}
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			fail(fmt.Errorf("parsing a document: %w", err))
		}
		if meta.Kind == "" {
			fail(fmt.Errorf("a document without kind: %.200s", doc))
		}
		if !keep["all"] && !keep[meta.Kind] {
			continue
		}
		// virt-operator creates these through typed clients, so their TypeMeta was never used:
		// KubeVirt sets apiVersion "v1" on its ValidatingAdmissionPolicy(Binding) (v1.6-v1.8).
		if group, ok := groupOf[meta.Kind]; ok && meta.APIVersion == "v1" {
			doc = strings.Replace(doc, "apiVersion: v1\n", "apiVersion: "+group+"/v1\n", 1)
		}
		fmt.Fprintf(out, "---\n%s\n", doc)
	}
}

// decode undoes the install strategy's gzip+base64 encoding of its manifests.
func decode(s string) (string, error) {
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return "", err
	}
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if _, err := io.Copy(&b, zr); err != nil {
		return "", err
	}
	return b.String(), nil
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "install-manifests: %v\n", err)
	os.Exit(1)
}
