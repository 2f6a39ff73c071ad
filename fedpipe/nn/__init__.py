"""The networks: the papers' classic models (`networks`), multi-branch layers for pFedMB
(`multibranch`) and FedMN's modular network (`modular`)."""
