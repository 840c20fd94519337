#!/usr/bin/env bash
# Makes the numbers and plots of docs/results.md (the Fashion-MNIST versions), on the CPU.
# Finished runs are kept in the store and skipped, so this can be stopped and started again;
# add seeds with e.g. --set 'seed=[0,1]'.
set -euo pipefail
cd "$(dirname "$0")/.."
DB=${DB:-results/paper.sqlite}
RUN="robustbn run --db $DB --jobs ${JOBS:-2} --quiet"
$RUN scenarios/fbn_fig4_fmnist.toml
$RUN scenarios/fbn_fig4_control_fmnist.toml
$RUN scenarios/fbn_fig3_fmnist.toml --set 'gamma=[0.0, 0.1, 0.5, 1.0]'
$RUN scenarios/fbn_gap_cause_fmnist.toml
$RUN scenarios/fbn_central_gap_fmnist.toml
$RUN scenarios/fbn_central_gap_fmnist.toml --set n=10 --set batch_size=50 --set norm=fbn --set f=3 --set 'bn_attack=["sf","none"]'
# a second seed where time allowed: every run of Figure 4 at gamma = 0, and its control
$RUN scenarios/fbn_fig4_fmnist.toml --set gamma=0.0 --set seed=1
$RUN scenarios/fbn_fig4_control_fmnist.toml --set gamma=0.0 --set seed=1
$RUN scenarios/fbn_sf_cause_fmnist.toml
$RUN scenarios/hbn_table1_fmnist.toml
$RUN scenarios/fedbn_feature_shift_fmnist.toml

robustbn toy --out docs/img/toy.png
robustbn plot heterogeneity --db $DB --where dataset=fashion-mnist --where f=0 --where rounds=200 --where algorithm=dsgd \
  --where bn_agg=mean --where n=10 --where bn_momentum=0.1 --out docs/img/fig3a_fmnist.png --title "Fashion-MNIST: final accuracy vs heterogeneity (seed 002, Fig. 3a)"
for g in 0.0 0.01; do
  robustbn plot heatmap --db $DB --where rounds=200 --where partition=gamma --where gamma=$g --where f=3 \
    --out docs/img/fig4_heatmap_gamma$g.png --title "f = 3 of 10 attack the BN statistics (none: they send nothing), gamma = $g (seed 002, Fig. 4, C.3)"
  for attack in sf foe alie; do
    robustbn plot curves --db $DB --where rounds=200 --where gamma=$g --where bn_attack=$attack --where f=3 \
      --out docs/img/fig4_curves_${attack}_gamma$g.png --title "$attack on the BN statistics, gamma = $g"
  done
done
robustbn plot curves --db $DB --where algorithm=fedavg --where partition=dirichlet \
  --out docs/img/hbn_table1_fmnist.png --title "Seed 003's setting on Fashion-MNIST (FedAvg, Dirichlet 0.6, batch 8)"
robustbn plot curves --db $DB --where partition=feature-shift \
  --out docs/img/fedbn_feature_shift.png --title "Feature shift (seed 004's setting) on Fashion-MNIST"
robustbn plot curves --db $DB --where gamma=0.0 --where rounds=1500 \
  --out docs/img/fbn_central_gap.png --title "FBN vs centralized BN at gamma = 0, the paper's schedule (T = 1500, momentum 0.99)"
robustbn results --db $DB --format csv > docs/results.csv
