// Package node holds the tests of rlagent as a user deploys it: the image
// `make image` builds, and (make test-node) that image run by a real kubelet
// with containerd, from the manifests in deploy/.
package node
